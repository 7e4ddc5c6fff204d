"""dflash-datagen's refusals that need only the settings and the file system.

The command runs them before it imports torch or loads the target, so a user's folder as
out_dir or a missing prompt file costs a second; pipeline.run runs them too (tests and
dflash-quickstart call it directly).
"""

from __future__ import annotations

from pathlib import Path

from data_gen.config import DatagenConfig
from data_gen.sources import source_file
from dflash_train.data import format as data_format
from dflash_train.errors import check_writable_dir

FILE_SOURCES = ("sharegpt", "jsonl")  # the source kinds that read one file


def check_inputs(cfg: DatagenConfig) -> None:
    """out_dir is absent, empty or a dflash-datagen output, and writable; every file source's
    file exists."""
    out = Path(cfg.out_dir)
    data_format.check_out_dir(out)
    check_writable_dir(out, "out_dir")
    for src in cfg.sources:
        if src.kind in FILE_SOURCES:
            source_file(src)
