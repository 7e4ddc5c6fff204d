"""One-line errors for every command, and the checks that let a command fail before long work.

Every console script (dflash-train, -datagen, -export, -eval, -quickstart) runs its body
through ``run_command``: the failures a user or the machine causes come out as one line
naming the file, value or URL, with exit status 2; anything else is a bug and keeps its
traceback. The known kinds:

  * ValueError: a setting, input file or model that cannot work (raised with the values);
  * OSError: what the operating system refused (read-only or full disk, a missing file,
    a file where a folder is expected, an unreachable server);
  * RunError: a run that cannot continue for a reason that is not a bug (a diverging loss).

Errors raised deep inside libraries often do not name the file they were reading; the code
that opens a file catches them there and raises a ValueError that does.
"""

from __future__ import annotations

import errno
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
EXIT_USER_ERROR = 2
# Free space a writer wants before it starts, when it cannot tell its output's size.
MIN_FREE_BYTES = 16 << 20
MAX_MESSAGE_CHARS = 600


class RunError(RuntimeError):
    """A run that cannot go on, through no bug of ours; the message says what to do."""


USER_ERRORS = (ValueError, OSError, RunError)


def one_line(err: BaseException) -> str:
    """The error as one line: OSError as 'strerror: file', others by their message."""
    if isinstance(err, OSError) and err.strerror and err.filename is not None:
        text = f"{err.strerror}: {err.filename}"
        if err.filename2 is not None:
            text += f" -> {err.filename2}"
    else:
        text = str(err) or type(err).__name__
    text = " ".join(text.split())  # library messages span lines; ours never do
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS - 3] + "..."


def run_command(prog: str, fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)``; a user error ends the process with one line on stderr."""
    try:
        return fn(*args, **kwargs)
    except USER_ERRORS as err:
        print(f"{prog}: error: {one_line(err)}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)


def check_writable_dir(path: str | os.PathLike, what: str, min_free_bytes: int = MIN_FREE_BYTES) -> None:
    """Raise ValueError unless ``path`` can be created (or is a folder) and written.

    Checked before long work starts, so a read-only or full location, or a file where a
    folder is expected, costs seconds and not the whole run. Nothing is left behind: the
    folders are not created, the probe file is removed.
    """
    path = Path(path).absolute()
    existing = path
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{what} {str(path)!r}: {str(existing)!r} is a file, not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".dflash-write-probe-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ValueError(f"{what} {str(path)!r} cannot be written ({err.strerror} in {str(existing)!r})") from None
    free = _free_bytes(existing)
    if free is not None and free < min_free_bytes:
        raise ValueError(f"{what} {str(path)!r}: only {free >> 20} MiB free on its disk, "
                         f"{-(-min_free_bytes >> 20)} MiB needed")


def _free_bytes(path: Path) -> int | None:
    try:
        stat = os.statvfs(path)
    except OSError as err:
        if err.errno in (errno.ENOSYS, errno.EOVERFLOW):
            return None
        raise
    return stat.f_bavail * stat.f_frsize
