"""Drafter kinds (`drafter.kind`): the model and config classes a recipe or a config.json means.

A kind is a model and its export, not a second training loop: every kind trains with the
same data, anchors, masks, trainer, checkpoints and backends. `dflash` is the contract's
drafter (model/dflash.py); `dflash2` adds z-lab's convolutions and candidate selector
(model/dflash2.py).
"""

from __future__ import annotations

from dflash_train.model.dflash import DFlashConfig, DFlashDraftModel
from dflash_train.model.dflash2 import ARCHITECTURE as DFLASH2_ARCHITECTURE
from dflash_train.model.dflash2 import DFlash2Config, DFlash2DraftModel

KINDS = {"dflash": (DFlashConfig, DFlashDraftModel), "dflash2": (DFlash2Config, DFlash2DraftModel)}
# config.json `architectures[0]` -> kind
ARCHITECTURES = {"DFlashDraftModel": "dflash", DFLASH2_ARCHITECTURE: "dflash2"}


def check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"drafter kind {kind!r}; expected one of {list(KINDS)}")
    return kind


def kind_of(config) -> str:
    """The kind of a drafter config object (a DFlash2Config is a DFlashConfig too)."""
    return "dflash2" if isinstance(config, DFlash2Config) else "dflash"


def model_class(config) -> type[DFlashDraftModel]:
    """The drafter class that builds ``config``."""
    return KINDS[kind_of(config)][1]


def config_class(raw: dict) -> type[DFlashConfig]:
    """The config class of a config.json dict, by its `architectures` (DFlash when absent)."""
    archs = raw.get("architectures") or ["DFlashDraftModel"]
    return KINDS[ARCHITECTURES.get(str(archs[0]), "dflash")][0]
