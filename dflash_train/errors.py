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
import fnmatch
import json
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
EXIT_USER_ERROR = 2
# The names dflash_train.atomic gives a file or folder while it is written or replaced.
ATOMIC_TEMPS = (".*.tmp-*", ".*.old", ".*.old/*")
# check_writable_dir's probe file: another rank's, met for the moment it exists, is ours too.
WRITE_PROBE = ".dflash-write-probe-"
# The lock file of a folder a command writes (dflash_train.run_lock): present while it runs.
LOCK_FILE = ".dflash.lock"
# Foreign files named in a refusal: enough to recognise the folder, and the walk stops there.
SHOWN_FOREIGN = 3
# Free space a writer wants before it starts, when it cannot tell its output's size.
MIN_FREE_BYTES = 16 << 20
MAX_MESSAGE_CHARS = 600
# The marker a command writes first into its run folder, and the keys of dflash-datagen's
# (its settings fingerprint): how a command recognises another command's folder.
RUN_FILE = "run.json"
DATAGEN_RUN_KEYS = {"target", "tokenizer", "template", "sampling", "prompts_sha256"}


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
        fd, probe = tempfile.mkstemp(prefix=WRITE_PROBE, dir=existing)
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


def check_own_folder(path: str | os.PathLike, what: str, prog: str, own: Sequence[str],
                     proof: Callable[[Path], bool] | None = None) -> None:
    """The one rule of every command that writes into a folder: it refuses a folder that
    holds files it did not write, and says so in one line before any work.

    ``path`` may be absent or empty. Otherwise every file under it, and every empty folder
    (as ``name/``), must match one of the ``own`` patterns: relative paths, where ``*``
    spans folders (``checkpoints/*``) and the names of ``ATOMIC_TEMPS`` are always ours.
    ``proof(path)`` tells whether the files named like ours are ours (a marker file, a
    content only we write); without it the folder is the user's: their own metrics.jsonl
    is not ours for having the name.
    """
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return
    if not path.is_dir():
        raise ValueError(f"{what} {str(path)!r} exists and is not a folder; choose an empty or new folder")
    other = folder_writer(path)
    if other is not None and other != prog:
        raise ValueError(f"{what} {str(path)!r} holds a {other} run, not a {prog} one: it is left untouched; "
                         "choose an empty or new folder")
    foreign = foreign_files(path, (*own, *ATOMIC_TEMPS, LOCK_FILE, WRITE_PROBE + "*"))
    entries = sorted(p.name for p in path.iterdir() if p.name != LOCK_FILE and not p.name.startswith(WRITE_PROBE))
    if proof is not None and entries and not proof(path):
        # Nothing here is ours, whatever the names: the ones named like ours are counted too.
        named = {f.split("/")[0] for f in foreign}
        foreign += [name for name in entries if name not in named]
    if foreign:
        shown = ", ".join(foreign[:SHOWN_FOREIGN]) + (f" and {len(foreign) - SHOWN_FOREIGN} more"
                                                      if len(foreign) > SHOWN_FOREIGN else "")
        raise ValueError(f"{what} {str(path)!r} holds files {prog} did not write ({shown}); they are "
                         "left untouched: choose an empty or new folder")


def folder_writer(path: Path) -> str | None:
    """The command whose run folder ``path`` is, by its run.json: the ``written_by`` of
    dflash-train and dflash-quality, the settings fingerprint of dflash-datagen (None: none)."""
    try:
        marker = json.loads((path / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict):
        return None
    if isinstance(marker.get("written_by"), str):
        return marker["written_by"]
    return "dflash-datagen" if DATAGEN_RUN_KEYS <= set(marker) else None


def foreign_files(folder: Path, own: Sequence[str], limit: int = SHOWN_FOREIGN) -> list[str]:
    """Up to ``limit`` relative paths under ``folder`` that no pattern of ``own`` matches,
    in sorted walk order. Links are not followed: a link is an entry like a file."""
    found: list[str] = []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        rel = Path(root).relative_to(folder)
        links = [d for d in dirs if os.path.islink(os.path.join(root, d))]
        names = [(rel / n).as_posix() for n in sorted(files + links)]
        if not dirs and not files and root != str(folder):
            names = [rel.as_posix() + "/"]  # an empty folder
        found += [n for n in names if not any(fnmatch.fnmatchcase(n, p) for p in own)]
        if len(found) >= limit:
            break
    return found[:limit]
