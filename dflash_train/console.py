"""Lines a person reads: every line a command prints or logs stays under MAX_LINE characters.

Detail that does not fit (a map of copied weights, a list of changed settings) goes to a file
in the run folder, and the line says where. Prose notes wrap at NOTE_WIDTH; commands wrap at
word boundaries with shell continuations, so they still paste into a shell.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

MAX_LINE = 200
NOTE_WIDTH = 100
INDENT = "    "


def note_lines(text: str, width: int = NOTE_WIDTH) -> list[str]:
    """A note wrapped into lines of at most ``width`` characters, the later ones indented."""
    return textwrap.wrap(text, width, subsequent_indent=INDENT, break_long_words=False, break_on_hyphens=False)


def command_lines(prefix: str, words: Sequence[str], width: int = NOTE_WIDTH) -> str:
    """``prefix`` and a command, wrapped before ``width`` with ``\\`` continuations."""
    lines, line = [], prefix.rstrip()
    for word in words:
        if len(line) + 1 + len(word) + 2 > width and line.strip():
            lines.append(line + " \\")
            line = INDENT + word
        else:
            line = f"{line} {word}" if line else word
    return "\n".join([*lines, line])
