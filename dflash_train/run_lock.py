"""One writer per run folder: every command holds the folder it writes while it runs.

    with hold_folder(cfg.output_dir, "output_dir", "dflash-train"):
        ...  # check the folder, load, train, export

The hold is an advisory lock (``flock``) on ``<folder>/.dflash.lock``, a file that names the
holder (its process id and command line). A second writer of the same folder is refused in
one line naming that process. The operating system drops the lock when the process ends,
however it ends (kill -9 included): a lock file left by a killed process holds nothing,
and the next writer simply takes it. The holder removes the file (and the folder, if it
created the folder and left it empty) when it is done.

Only rank 0 of a launch holds the folder: the other ranks write into it under rank 0's hold.
dflash-quality and dflash-quickstart hold their folders and run each stage as a child
process, which writes into the same folder (or one inside it) under its parent's hold: the
parent names itself in the child's environment (``stage_env``), and a folder held by the
child's own parent, so named, is the child's to write.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from dflash_train.distributed.launch import launch_env
from dflash_train.errors import LOCK_FILE, check_writable_dir

# Set by a parent command for its stage processes: the process id that holds their folders.
OWNER_ENV = "DFLASH_FOLDER_HOLDER"
_held: set[str] = set()  # folders this process holds: a nested hold of one of them is a no-op


class FolderInUse(ValueError):
    """Another process writes the folder now."""


def stage_env() -> dict[str, str]:
    """The environment of a stage process that writes into folders this process holds."""
    return {**os.environ, OWNER_ENV: str(os.getpid())}


@contextlib.contextmanager
def hold_folder(folder: str | os.PathLike, key: str, prog: str) -> Iterator[None]:
    """Hold ``folder`` (``key``'s value) for this command while the block runs; raise
    FolderInUse naming the holder if another process writes it."""
    path = os.path.realpath(folder)
    if launch_env().rank != 0 or path in _held:
        yield
        return
    check_writable_dir(path, key)  # its one-line reasons first: a file in the way, a read-only disk
    created = _missing_parents(Path(path))
    Path(path).mkdir(parents=True, exist_ok=True)
    fd = _lock(Path(path) / LOCK_FILE, key, prog)
    _held.add(path)
    try:
        yield
    finally:
        _held.discard(path)
        if fd is not None:
            (Path(path) / LOCK_FILE).unlink(missing_ok=True)  # still locked: a waiter sees it go
            os.close(fd)
        for folder_made in created:  # deepest first; one holding anything stays
            try:
                folder_made.rmdir()
            except OSError:
                break


def _missing_parents(path: Path) -> list[Path]:
    missing = []
    while not path.exists() and path.parent != path:
        missing.append(path)
        path = path.parent
    return missing


def _lock(lock_file: Path, key: str, prog: str) -> int | None:
    """The descriptor holding the lock, or None when this process's parent holds it for us."""
    while True:
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
            os.close(fd)
            if _parent_holds(holder):
                return None
            who = f"process {holder}" if holder else "another process"
            raise FolderInUse(f"{key} {str(lock_file.parent)!r} is in use by {who}: one command writes a folder "
                              "at a time; wait for it to finish or choose another folder") from None
        if _same_file(fd, lock_file):
            break
        os.close(fd)  # the holder finished and removed the file between our open and our lock
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()} ({' '.join([prog, *sys.argv[1:]])[:300]})\n".encode())
    return fd


def _parent_holds(holder: str) -> bool:
    pid = holder.split(" ", 1)[0]
    return pid.isdigit() and int(pid) == os.getppid() and os.environ.get(OWNER_ENV) == pid


def _same_file(fd: int, path: Path) -> bool:
    try:
        on_disk = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (on_disk.st_dev, on_disk.st_ino)
