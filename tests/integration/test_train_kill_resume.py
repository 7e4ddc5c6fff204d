"""kill -9 in the middle of `dflash-train`, run the same command again: the final drafter is
bitwise equal to an uninterrupted run's (CPU, one process, deterministic kernels)."""

import os
import signal
import time

import pytest
from safetensors.torch import load_file

from dflash_train.model.target import load_tokenizer
from tests.cli_helpers import run_cli, start_cli
from tests.conftest import SMOLLM2
from tests.train_data import save_tiny_target, write_datagen_dir

STEPS = 8  # 16 rows, global batch 4 (2 x 2 accumulation), 2 epochs


def _args(target, data, out):
    return [
        f"target.name={target}", "target.mask_token_id=16", "target.num_layers=6",
        "drafter.num_hidden_layers=1", "drafter.block_size=8", "drafter.attention=dense", "drafter.compile=false",
        f"data.path={data}", "data.num_anchors=6", "data.max_length=64",
        "optim.micro_batch_size=2", "optim.grad_accum_steps=2", "optim.lr=3e-3",
        "epochs=2", "logging.wandb=disabled", "logging.progress_bar=false", "logging.every=2",
        "checkpoint.every=2", "checkpoint.keep_last=2", "backend.device=cpu", f"output_dir={out}",
    ]


def _run(args):
    done = run_cli("dflash-train", *args, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
def test_kill_9_then_resume_matches_an_uninterrupted_run(tmp_path):
    tok = load_tokenizer(SMOLLM2)
    target = save_tiny_target(tmp_path / "target", tok)
    data = write_datagen_dir(tmp_path / "data", target, tok, repeat=2)

    _run(_args(target, data, tmp_path / "straight"))

    out = tmp_path / "killed"
    proc = start_cli("dflash-train", *_args(target, data, out))
    deadline = time.monotonic() + 300
    while not (out / "checkpoints" / "step_00000002").exists():
        assert proc.poll() is None, "training ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "export").exists(), "the killed run must not have finished"

    _run(_args(target, data, out))
    straight = load_file(tmp_path / "straight" / "export" / "model.safetensors")
    resumed = load_file(out / "export" / "model.safetensors")
    assert straight.keys() == resumed.keys()
    for name, tensor in straight.items():
        assert tensor.equal(resumed[name]), name
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) >= STEPS // 2  # the resumed run appended to the same metrics file
