"""Drafter kinds (`drafter.kind`): the model and config classes a recipe or a config.json means.

A kind is a model and its export, not a second training loop: every kind trains with the
same data, anchors, masks, trainer, checkpoints and backends. `dflash` is the contract's
drafter (model/dflash.py); `dflash2` adds z-lab's convolutions and candidate selector
(model/dflash2.py); `dspark` is DeepSeek's DSpark, whose slots predict one token further and
whose logits get a low-rank Markov term (model/dspark.py).
"""

from __future__ import annotations

from dflash_train.contract import DFLASH, DFLASH2, DSPARK
from dflash_train.model.dflash import DFlashConfig, DFlashDraftModel
from dflash_train.model.dflash2 import ARCHITECTURE as DFLASH2_ARCHITECTURE
from dflash_train.model.dflash2 import DFlash2Config, DFlash2DraftModel
from dflash_train.model.dspark import ARCHITECTURE as DSPARK_ARCHITECTURE
from dflash_train.model.dspark import DSparkConfig, DSparkDraftModel, is_dspark

# One entry per contract.DRAFTER_KINDS (contract.check_kind refuses any other kind name)
KINDS = {DFLASH: (DFlashConfig, DFlashDraftModel), DFLASH2: (DFlash2Config, DFlash2DraftModel),
         DSPARK: (DSparkConfig, DSparkDraftModel)}
# config.json `architectures[0]` -> kind
ARCHITECTURES = {"DFlashDraftModel": DFLASH, DFLASH2_ARCHITECTURE: DFLASH2, DSPARK_ARCHITECTURE: DSPARK}


def kind_of(config) -> str:
    """The kind of a drafter config object (a DFlash2Config or DSparkConfig is a DFlashConfig too)."""
    if is_dspark(config):
        return DSPARK
    return DFLASH2 if isinstance(config, DFlash2Config) else DFLASH


def model_class(config) -> type[DFlashDraftModel]:
    """The drafter class that builds ``config``."""
    return KINDS[kind_of(config)][1]


def new_drafter(config) -> DFlashDraftModel:
    """A freshly initialised drafter of the kind ``config`` describes."""
    return model_class(config)(config)


def config_class(raw: dict) -> type[DFlashConfig]:
    """The config class of a config.json dict, by its `architectures` (DFlash when absent)."""
    archs = raw.get("architectures") or ["DFlashDraftModel"]
    return KINDS[ARCHITECTURES.get(str(archs[0]), DFLASH)][0]
