"""dflash-train: compose the recipe, validate it, train, export.

    dflash-train --config-name train_quickstart
    launch/torchrun.sh --gpus 8 -- +experiment=qwen3_8b_8xh100 data.path=... output_dir=...

Settings are Hydra overrides of recipes/train.yaml (or of the recipe --config-name names):
key=value, group=option (target=qwen3_8b), +experiment=NAME.
"""

from __future__ import annotations

from pathlib import Path

from dflash_train.config import TrainConfig, validate
from dflash_train.errors import run_command
from dflash_train.recipe import load_command, log_to_stdout
from dflash_train.run_lock import hold_folder


def run(argv: list[str] | None = None) -> Path | None:
    """Train from a command line; returns the export directory (on the main process)."""
    cfg = load_command(TrainConfig, argv, "train", __doc__, validate)
    from dflash_train.training.trainer import (
        Trainer,  # after the recipe: a mistake fails in seconds
    )

    with hold_folder(cfg.output_dir, "output_dir", "dflash-train"):
        trainer = Trainer(cfg)
        try:
            return trainer.fit()
        finally:
            trainer.backend.shutdown()


def main(argv: list[str] | None = None) -> None:
    log_to_stdout()
    # A user mistake (recipe, data, target) or a refusal of the machine: one line, exit 2.
    export = run_command("dflash-train", run, argv)
    if export is not None:
        print(f"exported drafter to {export}")


if __name__ == "__main__":
    main()
