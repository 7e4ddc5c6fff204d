"""The tests' warm Python (tests/warm_python.py) runs a command as a fresh `python -m` does:
the same stdout, stderr and exit status, in the caller's working directory and environment."""

import os
import subprocess
import sys

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
