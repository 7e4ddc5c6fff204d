"""benchmarks/profile_step.py under torchrun: 2 gloo processes profile the same steps of the tiny
target's dflash-bench, and rank 0 prints the kernel tables with collectives as a kind of their
own, one line per rank, the collectives of a step and each step's batch and host time on every
rank; one process prints its tables as before."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed._backend_worker import RANK_PRELOAD, REPO_ROOT
from tests.warm_python import warm_python

pytestmark = pytest.mark.distributed

SCRIPT = REPO_ROOT / "benchmarks" / "profile_step.py"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.train_data import tiny_inputs

    inputs = tiny_inputs(tmp_path_factory.mktemp("tiny_profile"))
    return [f"target.name={inputs['target']}", "target.num_layers=6", "target.mask_token_id=16",
            "drafter.num_hidden_layers=1", "drafter.block_size=8", "drafter.attention=dense", "drafter.compile=false",
            f"data.path={inputs['data']}", "data.num_anchors=6", "data.max_length=64", "optim.micro_batch_size=1",
            "bench.steps=1", "bench.warmup=1"]


def profile(nproc: int, args: list[str]) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    warm = warm_python(env, RANK_PRELOAD)
    if warm is not None:
        done = warm.run_ranks(nproc, str(SCRIPT), args, env, timeout=300)
    else:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc-per-node={nproc}", str(SCRIPT), *args],
                              env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done.stdout


def kinds(out: str) -> dict[str, float]:
    table = out.split("device busy per step", 1)[1].split("top kernels:", 1)[0]
    return {m[1].strip(): float(m[2]) for m in re.finditer(r"^  (\D+?)\s+([\d.]+) ms", table, re.M)}


def collectives(out: str) -> dict[str, list[float]]:
    table = out.split("collectives per step (rank 0):", 1)[1].split("per step and rank", 1)[0].splitlines()[1:]
    return {cells[-1]: [float(c) for c in cells[:-1]] for cells in (line.split() for line in table) if cells}


@pytest.mark.parametrize("backend", ["ddp", "fsdp2"])
def test_two_ranks_print_collectives_and_a_line_each(backend, tiny, tmp_path):
    out = profile(2, [*tiny, f"backend={backend}", "--out", str(tmp_path / "report.txt"),
                      "--trace", str(tmp_path / "trace.json.gz")])
    assert out.count("device busy per step") == 1  # rank 0's tables only
    assert kinds(out)["collectives"] > 0
    ranks = re.findall(r"^rank (\d): step ([\d.]+) ms, device busy ([\d.]+) ms, idle ([\d.]+) ms, in collectives "
                       r"([\d.]+) ms \(([\d.]+) ms not overlapped\), host syncs (\d+) per step$", out, re.M)
    assert [r[0] for r in ranks] == ["0", "1"]
    for rank in ranks:
        step, busy, idle, inside, exposed = map(float, rank[1:6])
        assert step > 0 and busy > 0 and idle >= 0 and inside > 0 and 0 <= exposed <= inside
    calls = collectives(out)
    # per step: the loss denominator's and the metrics' all-reduces, then the gradients'
    # (gloo reduces FSDP2's reduce-scatters as all-reduces of the whole gradient)
    if backend == "ddp":
        assert list(calls) == ["all_reduce"] and calls["all_reduce"][0] == 3
    else:
        # the drafter layer's parameters, gathered for the forward and again for the backward,
        # the root's once (kept to the backward); all-reduces: the two of the step, the two
        # reduce-scatters and the clip's norm
        assert sorted(calls) == ["all_gather", "all_reduce"]
        assert calls["all_gather"][0] == 3 and calls["all_reduce"][0] == 5
        assert calls["all_gather"][2] > 0  # megabytes, from gloo's float32 shapes
    # each profiled step's batch on each rank (one row of the tiny data), as its host built and ran it
    steps = re.findall(r"^  step +(\d+)  rank 0: +(\d+) tok +(\d+) rows +([\d.]+) ms +([\d.]+) ms  \|  "
                       r"rank 1: +(\d+) tok +(\d+) rows +([\d.]+) ms +([\d.]+) ms$", out, re.M)
    assert len(steps) == 3 and [int(s[0]) for s in steps] == list(range(int(steps[0][0]), int(steps[0][0]) + 3))
    for s in steps:
        assert s[2] == s[6] == "1" and int(s[1]) > 0 and int(s[5]) > 0
        assert all(float(ms) > 0 for ms in (s[3], s[4], s[7], s[8]))
    report = (tmp_path / "report.txt").read_text()
    assert "rank 1:" in report and "collectives per step (rank 0)" in report
    other = (tmp_path / "rank1-report.txt").read_text()  # rank 1's own tables, for the slow rank of a pair
    assert "device busy per step" in other and "collectives per step (rank 1)" in other and "rank 0:" in other
    assert (tmp_path / "trace.json.gz").is_file() and (tmp_path / "rank1-trace.json.gz").is_file()


def test_one_process_prints_its_tables_alone(tiny):
    out = profile(1, [*tiny, "backend=single"])
    assert "device busy per step" in out and "matmuls by shape" in out
    assert "collectives" not in out and "rank 0:" not in out
