"""A training run's output_dir: what dflash-train writes there, and the rule that keeps the rest.

    <output_dir>/run.json        {"written_by": "dflash-train"}, written before anything
                                 else: it tells a rerun that the files beside it are ours
    checkpoints/ metrics.jsonl   (checkpoint.py, logging.py)
    init_from_target.json        {drafter weight: target weight} of drafter.init_from_target
    wandb/                       wandb's own folder when logging.wandb is not disabled
    export/ data_manifest.json   the final export and the data manifest (EXPORT_DIR, MANIFEST_COPY):
                                 dflash-export finds them here again for the model card

A folder holding anything else, or these names without run.json (or a checkpoint, which
runs of older versions left without run.json), is the user's: errors.check_own_folder
refuses it in one line before anything loads.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Sequence
from pathlib import Path

from dflash_train.atomic import atomic_write_text
from dflash_train.config import LoggingConfig
from dflash_train.errors import check_own_folder

RUN_FILE = "run.json"
METRICS_FILE = "metrics.jsonl"
CHECKPOINT_DIR = "checkpoints"
STEP_DIR = re.compile(r"^step_(\d+)$")  # a checkpoint's folder in CHECKPOINT_DIR
EXPORT_DIR = "export"
MANIFEST_COPY = "data_manifest.json"
INIT_MAP_FILE = "init_from_target.json"
WRITTEN_BY = "dflash-train"
OWN_FILES = (RUN_FILE, METRICS_FILE, INIT_MAP_FILE, f"{CHECKPOINT_DIR}/*", "wandb/*")


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINT_DIR


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def _ours(output_dir: Path) -> bool:
    marker = output_dir / RUN_FILE
    if not marker.exists():
        return bool(list_checkpoints(output_dir))
    try:
        content = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(content, dict) and content.get("written_by") == WRITTEN_BY


def check_output_dir(output_dir: str | Path, extra: Sequence[str] = (), key: str = "output_dir") -> None:
    """Raise ValueError unless ``output_dir`` is absent, empty or a run of ours; ``extra``:
    more patterns the caller writes there (its export folder, the data manifest); ``key``:
    the caller's name for the folder (dflash-quickstart's run_dir)."""
    check_own_folder(output_dir, key, WRITTEN_BY, (*OWN_FILES, *extra), _ours)


def check_train_output_dir(output_dir: str | Path) -> None:
    """check_output_dir for dflash-train, which also writes its export and the data manifest;
    imports no torch, so the command refuses a user's folder before loading anything."""
    check_output_dir(output_dir, (f"{EXPORT_DIR}/*", MANIFEST_COPY))


def check_sinks(cfg: LoggingConfig) -> None:
    """Fail before any model is loaded when a configured sink cannot work."""
    if cfg.wandb != "disabled" and importlib.util.find_spec("wandb") is None:
        raise ValueError(
            f"logging.wandb={cfg.wandb!r} needs wandb: pip install 'dflash-train[wandb]', "
            "or set logging.wandb=disabled"
        )


def mark_output_dir(output_dir: str | Path) -> None:
    """Claim ``output_dir`` for this run, after ``check_output_dir`` let it through."""
    path = Path(output_dir) / RUN_FILE
    if not path.exists():
        atomic_write_text(path, json.dumps({"written_by": WRITTEN_BY}) + "\n")
