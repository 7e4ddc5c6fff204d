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

The distributed tests' ranks come from such a process too (`run_ranks`, in place of torchrun):
it forks one child per rank with the variables torchrun gives a worker (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...), each running the worker script as `python SCRIPT
ARGS` would, and, as torchrun does, kills the other ranks as soon as one fails. Rank 0 hosts
the process group's store (torchrun's agent would); the ranks share the server's hash seed,
where fresh interpreters would each draw their own.

Run as a script, this file is the server: requests on stdin, one JSON line each, answered by
two lines on stdout (the children's pids, then their exit statuses).
"""

from __future__ import annotations

import atexit
import contextlib
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
    def __init__(self, env: dict[str, str], preload: tuple[str, ...] = PRELOADED):
        self.env, self.preload = dict(env), preload
        self.workdir = Path(tempfile.mkdtemp(prefix="warm-python-"))
        with open(self.workdir / "imports.err", "wb") as err:  # what the imports print, C code's too
            self.proc = subprocess.Popen([sys.executable, __file__, *preload], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, env=self.env)
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

    def _request(self, request: dict, cmd: list[str], timeout: float) -> list[tuple[int, int]]:
        """Sends ``request``; (child's index, exit status) of each child it forks, in the order
        they ended."""
        return self._statuses(self._send(request), cmd, timeout)

    def _send(self, request: dict) -> list[int]:
        """Sends ``request``; the pids of the children it forked (``_statuses`` must follow
        before the next request)."""
        os.write(self.proc.stdin.fileno(), (json.dumps(request) + "\n").encode())
        return json.loads(self._line(60))

    def _ended(self) -> bool:
        """Whether the server has written the exit statuses of the last request's children."""
        return bool(select.select([self.proc.stdout.fileno()], [], [], 0)[0])

    def _statuses(self, pids: list[int], cmd: list[str], timeout: float) -> list[tuple[int, int]]:
        """(index in ``pids``, exit status) of each child as it ended; all killed after ``timeout``."""
        codes = self._line(timeout)
        if codes is None:  # the server has not reaped them, so the pids are still theirs
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self._line(60)
            raise subprocess.TimeoutExpired(cmd, timeout, *self._outputs(len(pids)))
        return [tuple(pair) for pair in json.loads(codes)]

    def _outputs(self, n: int) -> tuple[str, str]:
        """The stdout and stderr of the ``n`` children of the last request, one after another."""
        return tuple("".join((self.workdir / f"{name}{i}").read_text(errors="replace") for i in range(n))
                     for name in ("stdout", "stderr"))

    def run_module(self, module: str, args: list[str], env: dict[str, str], cwd, timeout: float) -> subprocess.CompletedProcess:
        """`python -m module *args` in ``cwd`` (the caller's working directory if None)."""
        cmd = [sys.executable, "-m", module, *args]
        request = {"module": module, "args": args, "cwd": str(cwd or os.getcwd()), "env": env,
                   "out": str(self.workdir)}
        ((_, code),) = self._request(request, cmd, timeout)
        return subprocess.CompletedProcess(cmd, code, *self._outputs(1))

    def start_module(self, module: str, args: list[str], env: dict[str, str], cwd) -> Started:
        """`python -m module *args` in ``cwd``, started and not waited for (``run_module``'s
        first half): a handle to poll, kill and wait for, as a Popen's. No other request may
        come before its ``wait``."""
        cmd = [sys.executable, "-m", module, *args]
        request = {"module": module, "args": args, "cwd": str(cwd or os.getcwd()), "env": env,
                   "out": str(self.workdir)}
        return Started(self, self._send(request), cmd)

    def run_ranks(self, nproc: int, script: str, args: list[str], env: dict[str, str],
                  timeout: float) -> subprocess.CompletedProcess:
        """`torchrun --standalone --nproc-per-node NPROC SCRIPT *args` on this host: ``nproc``
        forked ranks; the output is every rank's, rank 0's first. As torchrun's, the exit status
        is 1 when a rank failed, and stderr ends with the first failure observed."""
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script,
               *args]
        request = {"script": script, "args": args, "nproc": nproc, "cwd": os.getcwd(), "env": env,
                   "out": str(self.workdir)}
        failed = [(rank, code) for rank, code in self._request(request, cmd, timeout) if code]
        out, err = self._outputs(nproc)
        if failed:
            err += f"first observed failure: rank {failed[0][0]} (exit status {failed[0][1]})\n"
        return subprocess.CompletedProcess(cmd, 1 if failed else 0, out, err)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        shutil.rmtree(self.workdir, ignore_errors=True)


class Started:
    """A command ``WarmPython.start_module`` started: ``pid``, ``poll``, ``kill`` and ``wait``
    as a subprocess.Popen's (the server, its parent, reaps it as soon as it ends)."""

    def __init__(self, warm: WarmPython, pids: list[int], cmd: list[str]):
        self.warm, self.pid, self.cmd, self.returncode = warm, pids[0], cmd, None

    def poll(self) -> int | None:
        if self.returncode is None and self.warm._ended():
            self.wait()
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # it ended, not yet polled
                os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float = 600) -> int:
        if self.returncode is None:
            ((_, self.returncode),) = self.warm._statuses([self.pid], self.cmd, timeout)
        return self.returncode


# The warm processes by environment, the latest used last. The environment changes under a
# worker: importing deepspeed or compiling sets variables in os.environ for good
# (PYTORCH_NVML_BASED_CUDA_CHECK, TORCHINDUCTOR_CACHE_DIR), and some tests give a command its own.
_warm: dict[tuple, WarmPython] = {}
KEEP = 2  # processes kept per test worker (each holds torch and transformers imported)


def warm_python(env: dict[str, str], preload: tuple[str, ...] = PRELOADED) -> WarmPython | None:
    """The warm process for ``env`` that imported ``preload`` (started on first use), or None
    where a fresh one is needed."""
    key = (tuple(sorted((k, v) for k, v in env.items() if k not in VOLATILE)), preload)
    warm = _warm.pop(key, None) or WarmPython(env, preload)
    _warm[key] = warm
    while len(_warm) > KEEP:
        _warm.pop(next(iter(_warm))).close()
    return warm if warm.usable else None


@atexit.register
def _close_all() -> None:
    for warm in _warm.values():
        warm.close()


def _serve(preload: list[str]) -> None:
    """The server loop; a forked child leaves it by running its command to the interpreter's exit."""
    import threading

    before = dict(os.environ)
    for name in preload:
        __import__(name)
    # what the imports set for good (deepspeed's, for one); a fresh process importing them has it too
    added = {k: v for k, v in os.environ.items() if before.get(k) != v}
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
        n = request.get("nproc", 1)
        port = _free_port() if "nproc" in request else None
        pids = []
        for i in range(n):
            pid = os.fork()
            if pid == 0:
                requests.close()
                replies.close()
                _exit(_become(request, i) if port is None else _become_rank(request, i, port, added))
            pids.append(pid)
        print(json.dumps(pids), file=replies, flush=True)
        print(json.dumps(_wait_all(pids)), file=replies, flush=True)


def _wait_all(pids: list[int]) -> list[tuple[int, int]]:
    """(index in ``pids``, exit status) of each child as it ends; once one fails, the others are
    killed (torchrun's agent does so: a rank left alone would wait in a collective for its
    timeout)."""
    ended = []
    while len(ended) < len(pids):
        pid, status = os.wait()
        ended.append((pids.index(pid), os.waitstatus_to_exitcode(status)))
        if ended[-1][1]:
            for other in set(range(len(pids))) - {i for i, _ in ended}:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pids[other], signal.SIGKILL)
    return ended


def _free_port() -> int:
    """A port for rank 0's store, picked as torchrun picks one (bound to port 0, then released)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def _redirect(out: str, index: int) -> None:
    for fd, name in ((1, "stdout"), (2, "stderr")):
        f = os.open(os.path.join(out, f"{name}{index}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)


def _run(run, path: str) -> int:
    """``run(path)`` as the interpreter's main program; its exit status."""
    try:
        run(path)
    except SystemExit as e:  # what the interpreter makes of sys.exit's argument
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


def _become(request: dict, index: int) -> int:
    """In the forked child: what `python -m MODULE ARGS` in ``cwd`` would be, output to files;
    returns the exit status."""
    import runpy

    _redirect(request["out"], index)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.path[0] = os.getcwd()  # where `python -m` puts the working directory
    sys.argv = [request["module"], *request["args"]]
    return _run(lambda module: runpy.run_module(module, run_name="__main__", alter_sys=True), request["module"])


def _become_rank(request: dict, rank: int, port: int, added: dict[str, str]) -> int:
    """In the forked child: rank ``rank`` of what `torchrun --standalone --nproc-per-node N
    SCRIPT ARGS` would start (its variables; rank 0 hosts the store), output to files."""
    import runpy

    _redirect(request["out"], rank)
    n = str(request["nproc"])
    os.environ.clear()
    os.environ.update({**request["env"], **added})
    # torchrun's, less TORCHELASTIC_ERROR_FILE (where its agent collects a failed rank's
    # traceback) and with TORCHELASTIC_USE_AGENT_STORE False: rank 0 hosts the store
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_NAME="default",
                      WORLD_SIZE=n, LOCAL_WORLD_SIZE=n, GROUP_WORLD_SIZE="1", ROLE_WORLD_SIZE=n,
                      MASTER_ADDR="localhost", MASTER_PORT=str(port), TORCHELASTIC_RESTART_COUNT="0",
                      TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID=f"warm-{os.getppid()}-{port}",
                      TORCHELASTIC_USE_AGENT_STORE="False",
                      TORCHELASTIC_SIGNALS_TO_HANDLE="SIGTERM,SIGINT,SIGHUP,SIGQUIT")
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    os.chdir(request["cwd"])
    script = request["script"]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # where `python SCRIPT` puts the script's folder
    sys.argv = [script, *request["args"]]
    return _run(lambda path: runpy.run_path(path, run_name="__main__"), script)


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
    _serve(sys.argv[1:])
