"""A drafter folder's files, read without torch: its config.json and the safetensors files
that hold its weights (ours, or another trainer's: model/foreign.py).

model/foreign.py and model/io.py read a drafter through these; dflash-eval calls them
before it imports torch, so a folder that is no drafter is refused in a second.
"""

from __future__ import annotations

import json
from pathlib import Path

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
PICKLED_WEIGHTS = ("pytorch_model.bin", "training_state.pt", "model.pt")


def read_raw_config(path: Path) -> dict:
    file = path / CONFIG_NAME
    if not file.is_file():
        raise ValueError(f"{path}: no {CONFIG_NAME}; not a DFlash drafter export")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{file}: not valid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{file}: expected a JSON object, found {type(raw).__name__}")
    return raw


def weight_files(path: Path) -> list[str]:
    """The safetensors files of a checkpoint folder (one file or an index of shards); pickle
    files are never named (unpickling runs code)."""
    index = path / INDEX_NAME
    if index.is_file():
        try:
            return sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError) as err:
            raise ValueError(f"{index}: not a safetensors index ({err})") from None
    if (path / WEIGHTS_NAME).is_file():
        return [WEIGHTS_NAME]
    pickled = [n for n in PICKLED_WEIGHTS if (path / n).exists()]
    hint = f" (found {pickled[0]}, a pickle, which is never loaded: save the weights as safetensors)" if pickled else ""
    raise ValueError(f"{path}: no {WEIGHTS_NAME}{hint}")
