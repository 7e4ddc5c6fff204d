"""Shared by the tests of failures: run a console command as a user would, check that it
failed with one line naming what is wrong, and that nothing of the user's changed."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from tests.warm_python import warm_python

MODULES = {"dflash-train": "dflash_train.train", "dflash-datagen": "data_gen.cli",
           "dflash-export": "dflash_train.export.cli", "dflash-eval": "dflash_train.eval.cli",
           "dflash-quickstart": "dflash_train.quickstart", "dflash-bench": "dflash_train.bench",
           "dflash-quality": "dflash_train.quality"}


def run_cli(prog: str, *args, cwd=None, env=None, timeout=300) -> subprocess.CompletedProcess:
    """The console script ``prog`` (as its module, with this interpreter) in a subprocess: one
    forked from a process that imported torch and transformers already (tests/warm_python.py)
    when it has this environment, else a fresh interpreter."""
    full_env = {**os.environ, "WANDB_MODE": "disabled", **(env or {})}
    warm = warm_python(full_env)
    if warm is not None:
        return warm.run_module(MODULES[prog], [str(a) for a in args], full_env, cwd, timeout)
    return subprocess.run([sys.executable, "-m", MODULES[prog], *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=full_env, timeout=timeout)


def start_cli(prog: str, *args, env=None):
    """``run_cli``'s command started and not waited for (its output discarded): a Popen, or
    with a warm Python for this environment a ``warm_python.Started`` (pid, poll, kill, wait)."""
    full_env = {**os.environ, "WANDB_MODE": "disabled", **(env or {})}
    warm = warm_python(full_env)
    if warm is not None:
        return warm.start_module(MODULES[prog], [str(a) for a in args], full_env, None)
    return subprocess.Popen([sys.executable, "-m", MODULES[prog], *map(str, args)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=full_env)


def warm_stages(monkeypatch, module) -> None:
    """``module``'s stage commands (``subprocess.run([python, "-m", MODULE, ...], env=...)``, as
    dflash-quality starts its stages) forked from a warm Python for that environment, as
    ``run_cli`` does: each stage still runs in a process of its own with the stage's command line
    and environment, without the 5-8 s of importing torch and transformers. Their output goes to
    this process's file descriptors 1 and 2, where a fresh stage's would (capfd reads it)."""
    real = module.subprocess.run

    def run(command, env=None, **kwargs):
        warm = warm_python(env) if command[:2] == [sys.executable, "-m"] and env and not kwargs else None
        if warm is None:
            return real(command, env=env, **kwargs)
        done = warm.run_module(command[2], command[3:], env, None, timeout=900)
        for fd, text in ((1, done.stdout), (2, done.stderr)):
            os.write(fd, text.encode())
        return done

    monkeypatch.setattr(module, "subprocess", types.SimpleNamespace(run=run))


def assert_one_line_error(done: subprocess.CompletedProcess, prog: str, *needles: str) -> str:
    """Exit status 2 and stderr holding exactly one line of error text, naming ``needles``.

    Other stderr lines may be progress bars or warnings, never a traceback or another error."""
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    errors = [line for line in lines if any(w in line.lower() for w in ("error", "traceback", "exception"))]
    assert len(errors) == 1, done.stderr[-3000:]
    assert errors[0].startswith(f"{prog}: error: "), errors[0]
    for needle in needles:
        assert str(needle) in errors[0], (needle, errors[0])
    return errors[0]


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> bytes), to prove nothing changed."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


@contextlib.contextmanager
def read_only_dir(path: Path):
    """``path`` as a folder nobody may write into: a read-only tmpfs for root (who ignores
    permission bits), mode 0555 for anyone else."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a read-only tmpfs here")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


@contextlib.contextmanager
def full_disk(path: Path):
    """``path`` on a 1 MiB tmpfs with no space left (root only)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)],
                                           capture_output=True).returncode != 0:
        pytest.skip("a full disk needs a small tmpfs, which only root can mount")
    try:
        with open(path / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 65536)
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


# tqdm's "12/40 [00:03<00:09" (a progress bar redraws in place; it is not a log line)
PROGRESS = re.compile(r"\d+/\d+ \[\d")
# A library's warning through Python's warnings module: "/path/module.py:1789: FutureWarning: ..."
# (not ours to shorten; torch and transformers print their deprecations so)
LIBRARY_WARNING = re.compile(r"^\S+\.py:\d+: \w*Warning: ")


def readable_lines(output: str) -> list[str]:
    """The lines of ours a person reads: carriage returns end a line too; progress bars and
    libraries' warnings dropped."""
    return [line for line in re.split(r"[\r\n]", output)
            if line.strip() and not PROGRESS.search(line) and not LIBRARY_WARNING.match(line)]


def unwrap_commands(output: str) -> str:
    """Printed commands wrapped with shell continuations (console.command_lines) on one line again."""
    return re.sub(r" \\\n\s+", " ", output)
