"""dflash-train: compose the recipe, validate it, train, export.

    dflash-train --config-name train_quickstart
    launch/torchrun.sh --gpus 8 -- +experiment=qwen3_8b_8xh100 data.path=... output_dir=...
"""

from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import DictConfig

from dflash_train.config import to_train_config
from dflash_train.errors import run_command
from dflash_train.training.trainer import Trainer


def run(cfg: DictConfig) -> Path | None:
    """Train from a composed recipe; returns the export directory (on the main process)."""
    trainer = Trainer(to_train_config(cfg))
    try:
        return trainer.fit()
    finally:
        trainer.backend.shutdown()


@hydra.main(config_path="pkg://dflash_recipes", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    # A user mistake (recipe, data, target) or a refusal of the machine: one line, exit 2.
    export = run_command("dflash-train", run, cfg)
    if export is not None:
        print(f"exported drafter to {export}")


if __name__ == "__main__":
    main()
