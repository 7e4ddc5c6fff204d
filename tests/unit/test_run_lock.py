"""One writer per run folder: every command that writes a folder holds it while it runs,
refuses a second writer in one line naming the holder, and takes over the folder of a
process that was killed."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dflash_train.errors import LOCK_FILE
from dflash_train.run_lock import FolderInUse, hold_folder, stage_env
from tests.cli_helpers import assert_one_line_error, run_cli, snapshot
from tests.train_data import tiny_inputs, tiny_train_args

ROOT = Path(__file__).resolve().parents[2]


def start_holder(folder: Path, prog: str = "dflash-train", env: dict | None = None) -> subprocess.Popen:
    """A process holding ``folder`` (as ``prog`` would) until its stdin closes."""
    code = textwrap.dedent(f"""
        import sys
        from dflash_train.run_lock import hold_folder
        with hold_folder({str(folder)!r}, "output_dir", {prog!r}):
            print("held", flush=True)
            sys.stdin.read()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=ROOT, env=env)
    assert proc.stdout.readline().strip() == "held"
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    assert proc.wait(timeout=60) == 0


def test_a_hold_names_its_holder_and_leaves_nothing_behind(tmp_path):
    folder = tmp_path / "new" / "run"
    with hold_folder(folder, "output_dir", "dflash-train"):
        text = (folder / LOCK_FILE).read_text()
        assert text.startswith(f"{os.getpid()} (dflash-train")
        with hold_folder(folder, "output_dir", "dflash-train"):  # the same process again: no second lock
            pass
        assert (folder / LOCK_FILE).exists()
    assert not (tmp_path / "new").exists()  # it made the folders, and they are empty again
    kept = tmp_path / "kept"
    kept.mkdir()
    with hold_folder(kept, "output_dir", "dflash-train"):
        (kept / "metrics.jsonl").write_text("{}\n")
    assert sorted(p.name for p in kept.iterdir()) == ["metrics.jsonl"]


def test_a_second_writer_is_refused_naming_the_first(tmp_path):
    holder = start_holder(tmp_path / "run")
    try:
        with pytest.raises(FolderInUse, match=rf"output_dir '{tmp_path / 'run'}' is in use by process "
                                              rf"{holder.pid} \(dflash-train"):
            with hold_folder(tmp_path / "run", "output_dir", "dflash-train"):
                pass
    finally:
        stop(holder)
    with hold_folder(tmp_path / "run", "output_dir", "dflash-train"):  # free again
        pass


def test_the_folder_of_a_killed_process_is_free(tmp_path):
    holder = start_holder(tmp_path / "run")
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(timeout=60)
    assert (tmp_path / "run" / LOCK_FILE).exists()  # left behind, holding nothing
    with hold_folder(tmp_path / "run", "output_dir", "dflash-train"):
        assert (tmp_path / "run" / LOCK_FILE).read_text().startswith(f"{os.getpid()} ")
    assert not (tmp_path / "run" / LOCK_FILE).exists()


def test_a_stage_writes_under_its_parents_hold_and_nobody_else_does(tmp_path):
    """dflash-quality and dflash-quickstart run their stages as child processes in the
    folders they hold: the child of the holder, named in its environment, writes there; a
    child not so named, or a process whose parent is not the holder, is refused."""
    child = textwrap.dedent(f"""
        from dflash_train.run_lock import hold_folder
        with hold_folder({str(tmp_path / 'run')!r}, "output_dir", "dflash-train"):
            print("wrote")
    """)
    parent = textwrap.dedent(f"""
        import subprocess, sys
        from dflash_train.run_lock import hold_folder, stage_env
        with hold_folder({str(tmp_path / 'run')!r}, "run_dir", "dflash-quickstart"):
            for env in (stage_env(), None):
                done = subprocess.run([sys.executable, "-c", {child!r}], env=env, capture_output=True, text=True)
                print(done.returncode, done.stdout.strip() or done.stderr.strip().splitlines()[-1])
    """)
    done = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    granted, refused = done.stdout.splitlines()
    assert granted == "0 wrote"
    assert refused.startswith("1 dflash_train.run_lock.FolderInUse: output_dir") and "is in use by process" in refused
    holder = start_holder(tmp_path / "run")  # a stranger with a holder's pid in its environment
    try:
        with pytest.raises(FolderInUse):
            os.environ["DFLASH_FOLDER_HOLDER"] = str(holder.pid)
            try:
                with hold_folder(tmp_path / "run", "output_dir", "dflash-train"):
                    pass
            finally:
                del os.environ["DFLASH_FOLDER_HOLDER"]
    finally:
        stop(holder)
    assert stage_env()["DFLASH_FOLDER_HOLDER"] == str(os.getpid())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_inputs(tmp_path_factory.mktemp("lock"))


def _fake_checkpoint(run: Path) -> Path:
    """A checkpoint of an older version (no checksums): enough for dflash-export to find it."""
    ckpt = run / "checkpoints" / "step_00000001"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text("{}")
    (ckpt / "config.yaml").write_text("{}")
    return ckpt


# Each command pointed at a folder another process writes: (arguments, the folder held, key).
def _commands(tiny, tmp: Path) -> dict:
    held = tmp / "held"
    return {
        "dflash-train": (tiny_train_args(tiny["target"], tiny["data"], held), held, "output_dir"),
        "dflash-datagen": ([f"out_dir={held}"], held, "out_dir"),
        "dflash-eval": (["drafter_path=random", f"output_dir={held}"], held, "output_dir"),
        "dflash-export": ([str(_fake_checkpoint(held))], held, "path"),
        "dflash-quality": (["target=smollm2_135m", f"data.path={tiny['data']}", "budget_min=1", f"run_dir={held}"],
                           held, "run_dir"),
        "dflash-quickstart": ([f"run_dir={held}"], held, "run_dir"),
        "dflash-bench": (["bench.random_target=true", f"output_dir={held}"], held, "output_dir"),
    }


@pytest.mark.parametrize("prog", ["dflash-train", "dflash-datagen", "dflash-eval", "dflash-export", "dflash-quality",
                                  "dflash-quickstart", "dflash-bench"])
def test_every_command_refuses_a_folder_another_writer_holds(tiny, prog, tmp_path):
    args, held, key = _commands(tiny, tmp_path)[prog]
    held.mkdir(exist_ok=True)
    before = snapshot(held)
    holder = start_holder(held)
    try:
        done = run_cli(prog, *args, cwd=tmp_path)
    finally:
        stop(holder)
    assert_one_line_error(done, prog, f"{key} '{held}' is in use by process {holder.pid} (dflash-train")
    assert snapshot(held) == before


def test_two_trainings_on_one_folder(tiny, tmp_path):
    """The issue's case: a second dflash-train on the folder a first one trains in is refused
    at once, and the first one's metrics stay whole (one line per step, in order)."""
    run = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "dflash_train.train",
                              *tiny_train_args(tiny["target"], tiny["data"], run, "epochs=100000")],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "WANDB_MODE": "disabled"})
    try:
        while not (run / "metrics.jsonl").exists():  # training, not only loading
            assert first.poll() is None, first.communicate()
            time.sleep(0.05)  # not a busy wait: it would take a core from the loading command
        second = run_cli("dflash-train", *tiny_train_args(tiny["target"], tiny["data"], run, "optim.lr=1e-2"))
        assert first.poll() is None  # still training: the refusal came from the lock
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=600)
    assert_one_line_error(second, "dflash-train", f"output_dir '{run}' is in use by process {first.pid} (dflash-train")
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1))
    with hold_folder(run, "output_dir", "dflash-train"):  # the killed first one holds nothing
        pass
