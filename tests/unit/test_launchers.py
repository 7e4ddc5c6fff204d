"""The launchers build the command a user's topology needs: torchrun.sh and deepspeed.sh are run
with PYTHON=echo, so the line they would exec is printed instead of run."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def launched(script: str, *args: str) -> list[str]:
    env = {**os.environ, "PYTHON": "echo"}
    out = subprocess.run(["bash", str(ROOT / "launch" / script), *args], env=env, capture_output=True, text=True,
                         check=True)
    return out.stdout.split()


@pytest.mark.parametrize("script", ["torchrun.sh", "deepspeed.sh"])
def test_launchers_run_training_or_with_bench_the_benchmark(script):
    train = launched(script, "--gpus", "2", "--", "backend=ddp", "bench.steps=3")
    bench = launched(script, "--gpus", "2", "--bench", "--", "backend=ddp", "bench.steps=3")
    assert train[train.index("dflash_train.train") + 1:] == ["backend=ddp", "bench.steps=3"]
    assert "dflash_train.bench" not in train
    assert bench[bench.index("dflash_train.bench") + 1:] == ["backend=ddp", "bench.steps=3"]
    assert "dflash_train.train" not in bench


def test_torchrun_launcher_gives_one_process_per_gpu_on_one_node():
    cmd = launched("torchrun.sh", "--gpus", "2", "--bench", "--", "backend=fsdp2")
    assert cmd[:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m"]


def test_launchers_refuse_an_unknown_option_naming_it():
    for script in ("torchrun.sh", "deepspeed.sh"):
        out = subprocess.run(["bash", str(ROOT / "launch" / script), "--gpu", "2"], env={**os.environ, "PYTHON": "echo"},
                             capture_output=True, text=True)
        assert out.returncode == 2 and f"{script}: unknown option '--gpu'" in out.stderr
