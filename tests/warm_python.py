"""A Python process that has already imported torch and transformers and forks a child for
each console command a test runs (tests/cli_helpers.run_cli).

Each command still runs in a process of its own, from `python -m MODULE ARGS` onwards: its
own working directory, stdout and stderr files, exit status (a signal's as a negative one,
like subprocess), and the normal interpreter exit (atexit handlers, flushed output). What it
skips is the 5-8 s every fresh interpreter spends importing torch and transformers, which
the suite paid about 80 times. Used only while the caller's environment equals the one this
process was started with (variables those libraries read at import time, such as
OMP_NUM_THREADS or HF_HUB_OFFLINE, were then read with the same values); otherwise, or when
the imports print anything (a fresh process would print it too, a fork would hide it), the
caller starts a fresh interpreter as before.

Run as a script, this file is the server: requests on stdin, one JSON line each, answered by
two lines on stdout (the child's pid, then its exit status).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

PRELOADED = ("torch", "transformers", "transformers.modeling_utils", "omegaconf", "hydra", "pyarrow")
VOLATILE = ("PYTEST_CURRENT_TEST",)  # pytest's own, set anew for each test; no library reads it on import


class WarmPython:
    def __init__(self, env: dict[str, str]):
        self.env = dict(env)
        self.workdir = Path(tempfile.mkdtemp(prefix="warm-python-"))
        with open(self.workdir / "imports.err", "wb") as err:  # what the imports print, C code's too
            self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, env=self.env)
        self.usable = self._line(600) == "ready" and not (self.workdir / "imports.err").read_bytes()
        if not self.usable:
            self.close()

    def _line(self, timeout: float) -> str | None:
        """One line from the server, or None when none came within ``timeout`` seconds."""
        fd, data = self.proc.stdout.fileno(), b""
        while not data.endswith(b"\n"):
            if not select.select([fd], [], [], timeout)[0]:
                return None
            byte = os.read(fd, 1)
            if not byte:
                raise RuntimeError(f"the warm Python process ended (status {self.proc.wait()})")
            data += byte
        return data.decode().strip()

    def run_module(self, module: str, args: list[str], env: dict[str, str], cwd, timeout: float) -> subprocess.CompletedProcess:
        """`python -m module *args` in ``cwd`` (the caller's working directory if None)."""
        out, err = self.workdir / "stdout", self.workdir / "stderr"
        request = {"module": module, "args": args, "cwd": str(cwd or os.getcwd()), "env": env,
                   "stdout": str(out), "stderr": str(err)}
        os.write(self.proc.stdin.fileno(), (json.dumps(request) + "\n").encode())
        pid = int(self._line(60))
        code = self._line(timeout)
        if code is None:  # the child is still running, so its pid is still its own
            os.kill(pid, signal.SIGKILL)
            self._line(60)
            raise subprocess.TimeoutExpired([sys.executable, "-m", module, *args], timeout, out.read_text(),
                                            err.read_text())
        return subprocess.CompletedProcess([sys.executable, "-m", module, *args], int(code),
                                           out.read_text(errors="replace"), err.read_text(errors="replace"))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        shutil.rmtree(self.workdir, ignore_errors=True)


# The warm processes by environment, the latest used last. The environment changes under a
# worker: importing deepspeed or compiling sets variables in os.environ for good
# (PYTORCH_NVML_BASED_CUDA_CHECK, TORCHINDUCTOR_CACHE_DIR), and some tests give a command its own.
_warm: dict[tuple, WarmPython] = {}
KEEP = 2  # processes kept per test worker (each holds torch and transformers imported)


def warm_python(env: dict[str, str]) -> WarmPython | None:
    """The warm process for ``env`` (started on first use), or None where a fresh one is needed."""
    key = tuple(sorted((k, v) for k, v in env.items() if k not in VOLATILE))
    warm = _warm.pop(key, None) or WarmPython(env)
    _warm[key] = warm
    while len(_warm) > KEEP:
        _warm.pop(next(iter(_warm))).close()
    return warm if warm.usable else None


@atexit.register
def _close_all() -> None:
    for warm in _warm.values():
        warm.close()


def _serve() -> None:
    """The server loop; a forked child leaves it by running its command to the interpreter's exit."""
    import threading

    for name in PRELOADED:
        __import__(name)
    # a fork would copy a running thread's half-held locks
    if threading.active_count() != 1:
        print("not usable", flush=True)
        return
    requests, replies = os.fdopen(os.dup(0), "r"), os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(null, fd)
    os.close(null)
    print("ready", file=replies, flush=True)
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            requests.close()
            replies.close()
            _exit(_become(request))
        print(pid, file=replies, flush=True)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), file=replies, flush=True)


def _become(request: dict) -> int:
    """In the forked child: what `python -m MODULE ARGS` in ``cwd`` would be, output to files;
    returns the exit status."""
    import runpy

    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.path[0] = os.getcwd()  # where `python -m` puts the working directory
    sys.argv = [request["module"], *request["args"]]
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as e:  # what the interpreter makes of sys.exit's argument
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


def _exit(code: int) -> None:
    """The interpreter's exit up to the point where it would tear down every module: threads
    joined, atexit handlers run, output flushed. The teardown of torch and transformers
    (about a second, and nothing a fresh process would show) is skipped."""
    import atexit
    import threading

    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


if __name__ == "__main__":
    _serve()
