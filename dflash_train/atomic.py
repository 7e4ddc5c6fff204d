"""Atomic, durable writes: a file or a folder appears complete under its name, or not at all.

Everything is written under a temporary name beside its destination, fsynced, then renamed
into place, and the folder holding it is fsynced so that the rename itself survives a power
loss. A reader (a resumed run, a trainer reading a dataset, a runtime loading an export)
therefore never sees a half-written output, only the previous one or the new one.

``atomic_write`` is the helper; ``publish`` is its second half, for writers that fill the
temporary path themselves (the processes of a distributed checkpoint).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def fsync_dir(path: str | Path) -> None:
    """Make the entries of ``path`` (a creation or a rename inside it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str | Path) -> None:
    """fsync a file, or every file and folder under a folder (folders after their content)."""
    path = Path(path)
    if not path.is_dir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        return
    for root, _dirs, files in os.walk(path, topdown=False):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(root)


def publish(tmp: str | Path, path: str | Path, replace: bool = True) -> None:
    """Move the finished ``tmp`` (a file or a folder beside ``path``) to ``path`` in one rename.

    ``replace=False`` leaves an existing non-empty folder ``path`` in place and raises the
    OSError of the rename (a concurrent writer that finished first).
    """
    tmp, path = Path(tmp), Path(path)
    fsync_tree(tmp)
    if replace and tmp.is_dir() and path.is_dir() and not path.is_symlink():
        # A folder cannot be renamed over a non-empty one: the old one steps aside first,
        # so the name holds the old content or the new one at any moment but this rename.
        old = path.with_name(f".{path.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    elif replace:
        os.replace(tmp, path)
    else:
        os.rename(tmp, path)
    fsync_dir(path.parent)


def atomic_write(path: str | Path, write: Callable[[Path], None], folder: bool = False,
                 replace: bool = True) -> Path:
    """Run ``write(tmp)`` on a temporary path beside ``path``, then ``publish`` it there.

    ``write`` creates the file ``tmp``, or fills the folder ``tmp`` (created empty for it)
    when ``folder`` is true. If ``write`` raises, nothing is left behind and ``path`` is
    untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if folder:
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    else:
        # One writer per file name and process: the pid keeps concurrent writers apart.
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        publish(tmp, path, replace=replace)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically and durably."""
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file's content, read in chunks (checkpoints and datasets record them)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()
