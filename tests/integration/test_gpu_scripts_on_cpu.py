"""The GPU scripts of the benchmarks, run end to end on CPU with their CPU_SMOKE=1 settings: the
commands they compose are the ones the GPU calls run (the same keys, tiny sizes), so a key a CLI
no longer accepts or a broken table fails here instead of in a lease."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

# `make test-scripts`, before a lease: the runs take minutes each, outside `make test` (CI's budget);
# the refusal below is instant and stays in it
SCRIPTS = pytest.mark.scripts
ROOT = Path(__file__).resolve().parents[2]


def smoke(script: str, tmp_path: Path, *args: str, timeout: int, **env: str) -> str:
    """Runs ``bash script args`` with CPU_SMOKE=1 into tmp_path/run; its stdout (exit 0 asserted)."""
    environ = {**os.environ, "CPU_SMOKE": "1", "PYTHON": sys.executable, "R": str(tmp_path / "run"),
               "OUT": str(tmp_path / "out"), "OMP_NUM_THREADS": "1", **env}
    done = subprocess.run(["bash", script, *args], cwd=ROOT, env=environ, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def table_rows(out: str, first: str, keys: int) -> dict[tuple[str, ...], list[str]]:
    """The rows of the Markdown table whose header line starts with ``| first |``, keyed by their
    first ``keys`` cells."""
    lines = out.split(f"\n| {first} |", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    return {tuple(cells[:keys]): cells[keys:] for cells in ([c.strip() for c in line.strip("|").split("|")]
                                                            for line in lines)}


@SCRIPTS
@pytest.mark.slow
@pytest.mark.distributed
def test_two_gpu_script_benches_kills_and_resumes_on_gloo(tmp_path):
    """benchmarks/two-gpu/run.sh on DDP: dflash-bench on both geometries at 1 and 2 processes,
    and the resume runs, each resumed from the mid-run checkpoint (step 8 of 16) with the
    uninterrupted run's losses (float32: equal up to summation order; 1to2 against the run
    that continued on one process)."""
    out = smoke("benchmarks/two-gpu/run.sh", tmp_path, "0", "real", "paper", "resume", timeout=1200, BACKENDS="ddp")
    bench = table_rows(out, "geometry", 3)
    assert sorted(bench) == [(geo, "ddp", n) for geo in ("paper", "real") for n in ("1", "2")]
    for key, cells in bench.items():
        assert float(cells[0]) > 0 and cells[2].endswith("%") and cells[-1] == "0", (key, cells)
    resumed = table_rows(out, "backend", 2)
    assert sorted(resumed) == [("ddp", run) for run in ("1to2", "2to1", "killed")]
    for (_, run), cells in resumed.items():
        killed, start, compared, worst, within = cells
        assert start == "8" and within == "yes" and float(worst) < 1e-5, (run, cells)
        assert compared == "9-16 (8)", (run, cells)  # 1to2 against its 1-process reference, the others 2
    killed_at = int(re.search(r"two-gpu: killed with kill -9 at step (\d+)",
                              (tmp_path / "run" / "ddp-killed.log").read_text()).group(1))
    assert 10 <= killed_at < 16, "killed after the checkpoint, before the end"
    assert (tmp_path / "run" / "ddp-full1" / "metrics.jsonl").exists(), "1to2's reference ran"
    with tarfile.open(tmp_path / "out" / "two-gpu.tgz") as archive:
        names = archive.getnames()
    assert "./real-ddp-2.json" in names and "./ddp-killed/metrics.jsonl" in names
    assert not [n for n in names if "/checkpoints" in n or n.startswith("./tiny/")]


@SCRIPTS
@pytest.mark.slow
@pytest.mark.distributed
def test_two_gpu_script_runs_deepspeed_through_its_launcher(tmp_path):
    """The ZeRO side goes through launch/deepspeed.sh: the paper geometry's random target on 1
    and 2 processes."""
    out = smoke("benchmarks/two-gpu/run.sh", tmp_path, "0", "paper", timeout=900, BACKENDS="zero2")
    bench = table_rows(out, "geometry", 3)
    assert sorted(bench) == [("paper", "zero2", "1"), ("paper", "zero2", "2")]
    assert all(float(cells[0]) > 0 for cells in bench.values()), bench


def test_two_gpu_script_refuses_an_unknown_phase(tmp_path):
    done = subprocess.run(["bash", "benchmarks/two-gpu/run.sh", "0", "bench"], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "CPU_SMOKE": "1", "R": str(tmp_path)})
    assert done.returncode == 2 and "run.sh: unknown phase 'bench' (real, paper, resume or profile)" in done.stdout
    assert not list(tmp_path.iterdir()), "nothing ran"


@SCRIPTS
@pytest.mark.slow
def test_datagen_engine_script_profiles_both_attentions(tmp_path):
    """benchmarks/datagen_engine_gpu.sh: the every-turn job with magpie prompts on SmolLM2, SDPA
    and flex, each with its profile; the log comes back under OUT."""
    out = smoke("benchmarks/datagen_engine_gpu.sh", tmp_path, "0", "2", "1", timeout=900)
    assert re.search(r"^== \d+ s, finished$", out, re.M) and "EXIT 0" in out
    rows = {m.group(1): m.group(2).split() for m in re.finditer(r"^(engine(?:-flex)?) +(.*)$", out, re.M)}
    assert sorted(rows) == ["engine", "engine-flex"] and rows["engine"][0] == rows["engine-flex"][0]
    assert "profile (sdpa attention)" in out and "profile (flex attention)" in out
    assert (tmp_path / "out" / "datagen-profile.log").read_text().count("profile (") == 2


@SCRIPTS
@pytest.mark.slow
@pytest.mark.distributed
def test_datagen_two_gpu_script_answers_every_prompt_once_with_the_same_rows(tmp_path):
    """benchmarks/datagen_two_gpu.sh: the every-turn job with magpie prompts on SmolLM2, one process
    then two torchrun ranks on gloo (float32: every row equal, else the script fails); the table's
    rows, its scaling column and the check line; the logs come back under OUT."""
    out = smoke("benchmarks/datagen_two_gpu.sh", tmp_path, "0", timeout=900)
    assert re.search(r"^== \d+ s, finished$", out, re.M)
    rows = table_rows(out, "GPUs", 1)
    assert sorted(rows) == [("1",), ("2",)]
    for (gpus,), cells in rows.items():
        prompts, written, generated, _, answer_s, tokens_s, scaling, wall_scaling = cells
        assert prompts == "5" and written == "5" and int(generated) > 0, (gpus, cells)  # 3 conversations + 2 magpie
        assert float(answer_s) > 0 and float(tokens_s) > 0, (gpus, cells)
        assert (scaling.endswith("%") and wall_scaling.endswith("%")) == (gpus == "2"), (gpus, cells)
    assert rows[("1",)][2] == rows[("2",)][2], "the same tokens generated on one and two processes"
    assert "shards by rank: rank 0 2, rank 1 1" in out, "both ranks answered"
    assert ("check: every prompt id exactly once: 1 GPU(s) yes (5 distinct of 5 ids in the shards, 5 prompts), "
            "2 GPU(s) yes (5 distinct of 5 ids in the shards, 5 prompts); rows equal to the 1-GPU run's: 5 of 5") in out
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "datagen-two-gpu-gpus-1.log", "datagen-two-gpu-gpus-2.log", "datagen-two-gpu-job.log"]


@pytest.mark.parametrize("args", [("soon",), ("0", "2k"), ("0", "1", "2", "3"), ()])
def test_datagen_two_gpu_script_refuses_bad_arguments(tmp_path, args):
    done = subprocess.run(["bash", "benchmarks/datagen_two_gpu.sh", *args], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "CPU_SMOKE": "1", "R": str(tmp_path)})
    assert done.returncode == 2 and done.stdout.startswith("datagen_two_gpu: ") and done.stdout.count("\n") == 1
    assert "usage: datagen_two_gpu.sh WAIT_S [CONVERSATIONS] [MAGPIE]" in done.stdout
    assert not list(tmp_path.iterdir()), "nothing ran"


@SCRIPTS
@pytest.mark.slow
def test_side_by_side_script_runs_a_quality_run_into_its_table(tmp_path):
    """benchmarks/modelopt-side-by-side/run.sh, dflash-train's side (Model-Optimizer is no
    dependency of the tests): dflash-quality with the side-by-side settings for a 1-minute
    budget, its row in the table, its files in the archive."""
    out = smoke("benchmarks/modelopt-side-by-side/run.sh", tmp_path, "0", timeout=1200, TRAINERS="dflash",
                BUDGETS="1")
    assert re.search(r"^== dflash-1: \d+ s, finished$", out, re.M) and "EXIT 0" in out
    rows = table_rows(out, "trainer", 2)
    assert list(rows) == [("dflash-train", "1")]
    steps, taus = int(rows["dflash-train", "1"][1]), [float(c) for c in rows["dflash-train", "1"][3:8]]
    assert steps > 0 and all(t >= 1.0 for t in taus), rows
    with tarfile.open(tmp_path / "out" / "results.tgz") as archive:
        names = archive.getnames()
    assert {"./dflash-1/quality.json", "./dflash-1/eval_results.json", "./dflash-1/dflash-1.log"} <= set(names)


@SCRIPTS
def test_engine_compile_cost_counts_what_each_engine_compiles():
    """benchmarks/engine_compile_cost.py on CPU (a tiny model, empty caches): the answering engine
    compiles its forward and its token choice, the magpie writer in rows as long only its own
    choice, a second answering engine nothing, the magpie writer in rows of its own a forward."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.engine_compile_cost", "--device", "cpu", "--tiny",
                           "--slots", "4", "--max-prompt-len", "64", "--cold"], cwd=ROOT, capture_output=True,
                          text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].split()[:3] == ["engine", "temperature", "max_new"] and "caches cold" in lines[0]
    graphs = {line[:18].strip(): int(line[18:].split()[4]) for line in lines[1:5]}
    assert graphs == {"answer": 2, "magpie": 1, "answer again": 0, "magpie, own rows": 1}, lines
