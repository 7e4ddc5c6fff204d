"""The tests' warm Python (tests/warm_python.py) runs a command as a fresh `python -m` does:
the same stdout, stderr and exit status, in the caller's working directory and environment;
and starts a distributed script's ranks as torchrun does: the same variables, a working
process group, a failed rank ending the launch."""

import json
import os
import subprocess
import sys
import time

import pytest

from tests.warm_python import warm_python

PROBE = """
import atexit, os, sys
atexit.register(lambda: print("atexit ran"))
print(os.getcwd(), sys.path[0], os.environ.get("PROBE_VALUE"), sys.argv[1:])
print("to stderr", file=sys.stderr)
if sys.argv[1] == "raise":
    raise ValueError("boom")
sys.exit(int(sys.argv[1]) if sys.argv[1].isdigit() else sys.argv[1])
"""


@pytest.mark.parametrize("args", [["0"], ["3", "x y"], ["raise"], ["a message"]])
def test_a_forked_command_is_what_a_fresh_interpreter_gives(tmp_path, monkeypatch, args):
    (tmp_path / "probe_module.py").write_text(PROBE)
    monkeypatch.chdir(tmp_path)
    usual = {**os.environ, "WANDB_MODE": "disabled"}  # what run_cli passes
    warm = warm_python(usual)
    assert warm is not None and warm.usable
    env = {**usual, "PROBE_VALUE": "seen"}  # a command gets the environment it is given
    fresh = subprocess.run([sys.executable, "-m", "probe_module", *args], capture_output=True, text=True, env=env)
    forked = warm.run_module("probe_module", args, env, None, 60)
    assert (forked.returncode, forked.stdout) == (fresh.returncode, fresh.stdout)
    assert forked.stdout.splitlines()[0].startswith(f"{tmp_path} {tmp_path} seen")
    if args == ["raise"]:  # a traceback either way; the warm one has the frames of the fork too
        assert fresh.stderr.endswith("ValueError: boom\n") and forked.stderr.endswith("ValueError: boom\n")
    else:
        assert forked.stderr == fresh.stderr


def test_a_started_command_is_polled_killed_and_waited_for_as_a_popen(tmp_path, monkeypatch):
    """start_module's handle (kill_after_first_shard and the training kill test use it): poll is
    None while the command runs, SIGKILL ends it with status -9, and the server takes the next
    request; a command that ends by itself is seen by poll with its own status."""
    (tmp_path / "sleeper.py").write_text("import pathlib, sys, time\npathlib.Path('started').touch()\n"
                                         "time.sleep(float(sys.argv[1]))\nsys.exit(5)\n")
    monkeypatch.chdir(tmp_path)
    env = {**os.environ, "WANDB_MODE": "disabled"}
    warm = warm_python(env)
    started = warm.start_module("sleeper", ["600"], env, None)
    while not (tmp_path / "started").exists():
        assert started.poll() is None
        time.sleep(0.01)
    assert started.poll() is None
    started.kill()
    assert started.wait() == -9 and started.poll() == -9
    started.kill()  # ended: nothing to kill
    ends = warm.start_module("sleeper", ["0"], env, None)
    while ends.poll() is None:
        time.sleep(0.01)
    assert ends.returncode == 5 and warm.run_module("sleeper", ["0"], env, None, 60).returncode == 5


def test_a_changed_environment_gets_a_warm_process_of_its_own(monkeypatch):
    """Importing deepspeed, or compiling, sets variables in the worker's os.environ for good; the
    commands run after that must still fork from a process of their own environment."""
    usual = {**os.environ, "WANDB_MODE": "disabled"}
    first = warm_python(usual)
    # a variable no earlier test of the worker set (PYTORCH_NVML_BASED_CUDA_CHECK may be set already)
    monkeypatch.setenv("DFLASH_WARM_TEST_VARIABLE", str(os.getpid()))
    changed = {**os.environ, "WANDB_MODE": "disabled"}
    second = warm_python(changed)
    assert first is not None and second is not None and second is not first
    assert second.env == changed and second.usable
    assert warm_python(usual) is first  # kept: the two environments take turns without a restart


# Each rank records what torchrun's workers see: the variables the launch added to its
# environment, its script's place on sys.path, its arguments; then the ranks meet in a gloo
# process group (on the MASTER_ADDR/MASTER_PORT they were given) and sum their ranks + 1.
RANK_PROBE = """
import json, os, sys
import torch
import torch.distributed as dist
base = json.loads(open(sys.argv[1]).read())
added = {k: v for k, v in os.environ.items() if base.get(k) != v}
dist.init_process_group("gloo")
total = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(total)
record = {"added": added, "path0": sys.path[0], "argv": sys.argv, "cwd": os.getcwd(), "sum": total.item(),
          "rank": dist.get_rank(), "world": dist.get_world_size()}
open(f"rank{os.environ['RANK']}.json", "w").write(json.dumps(record))
dist.destroy_process_group()
print("rank", os.environ["RANK"], "done")
"""
# torchrun's own: a new port and run id each launch; its agent's error file and store, where
# the forked ranks have none (rank 0 hosts the store)
LAUNCH_OWN = ("MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE")


def _ranks(folder) -> list[dict]:
    records = [json.loads((folder / f"rank{r}.json").read_text()) for r in (0, 1)]
    for record in records:
        record["added"] = {k: v for k, v in record["added"].items() if k not in LAUNCH_OWN}
    return records


def test_forked_ranks_get_what_torchrun_gives_its_workers(tmp_path, monkeypatch):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("torchrun", "warm"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "probe.py").write_text(RANK_PROBE)
        (tmp_path / name / "base.json").write_text(json.dumps(env))
    monkeypatch.chdir(tmp_path / "torchrun")
    fresh = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                            "probe.py", "base.json"], capture_output=True, text=True, env=env, timeout=180)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    monkeypatch.chdir(tmp_path / "warm")
    warm = warm_python(env, ("torch",))
    forked = warm.run_ranks(2, "probe.py", ["base.json"], env, 60)
    assert forked.returncode == 0, forked.stderr[-3000:]
    assert forked.stdout == "rank 0 done\nrank 1 done\n"
    want, got = _ranks(tmp_path / "torchrun"), _ranks(tmp_path / "warm")
    for record in want + got:
        record["path0"], record["cwd"] = (os.path.relpath(record[k], tmp_path) for k in ("path0", "cwd"))
    assert got[1]["added"]["RANK"] == "1" and got[1]["added"]["WORLD_SIZE"] == "2" and got[1]["sum"] == 3.0
    assert [{**r, "path0": r["path0"].replace("warm", "torchrun"), "cwd": r["cwd"].replace("warm", "torchrun")}
            for r in got] == want


FAILING_RANK = """
import os, sys
import torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    print("rank 1 gives up", file=sys.stderr, flush=True)
    os._exit(3)
dist.barrier()  # never passed: rank 1 is gone, and gloo would wait for its timeout
"""


def test_a_failed_rank_ends_the_launch(tmp_path, monkeypatch):
    """As torchrun: the other ranks are stopped rather than left waiting in a collective, the
    exit status is 1, and stderr names the first failure."""
    (tmp_path / "fail.py").write_text(FAILING_RANK)
    monkeypatch.chdir(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = warm_python(env, ("torch",)).run_ranks(2, "fail.py", [], env, 120)  # TimeoutExpired if rank 0 hung
    assert done.returncode == 1
    assert done.stderr.endswith("rank 1 gives up\nfirst observed failure: rank 1 (exit status 3)\n")
