"""Atomic, durable writes: a file or a folder appears complete under its name, or not at all.

Everything is written under a temporary name beside its destination, fsynced, then renamed
into place, and the folder holding it is fsynced so that the rename itself survives a power
loss. A reader (a resumed run, a trainer reading a dataset, a runtime loading an export)
therefore never sees a half-written output, only the previous one or the new one.

``atomic_write`` is the helper; ``publish`` is its second half, for writers that fill the
temporary path themselves (the processes of a distributed checkpoint). A write that fails
because the disk is full says so in one line (``DiskFullError``), its temporary removed.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from dflash_train.errors import RunError

# Free space below which a failed write is taken for a full disk: libraries that write
# through their own streams (torch.save: "unexpected pos ...") lose the OSError's errno.
NEARLY_FULL_BYTES = 1 << 20
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class DiskFullError(RunError):
    """A write that failed for want of space; nothing partial was left under the name."""


def disk_full(err: BaseException, folder: str | Path) -> bool:
    """Whether ``err``, raised while writing into ``folder``, comes from a full disk (or quota)."""
    seen = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in DISK_FULL_ERRNOS:
            return True
        seen = seen.__cause__ or seen.__context__
    if not isinstance(err, (OSError, RuntimeError)):
        return False
    try:
        stat = os.statvfs(folder)
    except OSError:
        return False
    return stat.f_bavail * stat.f_frsize < NEARLY_FULL_BYTES


def disk_full_error(folder: str | Path, what: str, kept: str) -> DiskFullError:
    """The one line for a write that ran out of space: where, what, and what is kept."""
    return DiskFullError(f"no space left on the disk of {str(folder)!r} while writing {what}; {kept}: "
                         "free some space and run the same command again")


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


def _umask() -> int:
    mask = os.umask(0o022)  # reading it means setting it: set it back at once
    os.umask(mask)
    return mask


def follow_umask(path: str | Path) -> None:
    """Give ``path`` (a file, or a folder and all under it) the modes the umask gives a new
    file or folder: mkdtemp makes 0700 folders and some writers (safetensors) 0600 files,
    which a serving process of another account could not read."""
    path, mask = Path(path), _umask()
    if not path.is_dir():
        path.chmod(0o666 & ~mask)
        return
    for root, dirs, files in os.walk(path):
        os.chmod(root, 0o777 & ~mask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~mask)


def publish(tmp: str | Path, path: str | Path, replace: bool = True) -> None:
    """Move the finished ``tmp`` (a file or a folder beside ``path``) to ``path`` in one rename.

    ``replace=False`` leaves an existing non-empty folder ``path`` in place and raises the
    OSError of the rename (a concurrent writer that finished first).
    """
    tmp, path = Path(tmp), Path(path)
    follow_umask(tmp)
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
    except (OSError, RuntimeError) as err:
        if disk_full(err, path.parent):
            raise disk_full_error(path.parent, str(path), "nothing partial was left there") from err
        raise
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
