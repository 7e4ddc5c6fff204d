"""dflash-train: compose the recipe, validate it, train, export.

    dflash-train --config-name train_quickstart
    launch/torchrun.sh --gpus 8 -- +experiment=qwen3_8b_8xh100 data.path=... output_dir=...

Settings are Hydra overrides of recipes/train.yaml (or of the recipe --config-name names):
key=value, group=option (target=qwen3_8b), +experiment=NAME.
"""

from __future__ import annotations

from pathlib import Path

from dflash_train.config import TrainConfig, validate
from dflash_train.data.format import read_manifest
from dflash_train.distributed.launch import launch_env
from dflash_train.errors import run_command
from dflash_train.recipe import load_command, log_to_stdout
from dflash_train.run_lock import hold_folder
from dflash_train.training.run_dir import check_sinks, check_train_output_dir


def load(argv: list[str] | None = None) -> TrainConfig:
    """The validated settings of a command line; loads nothing."""
    return load_command(TrainConfig, argv, "train", __doc__, validate)


def check_inputs(cfg: TrainConfig) -> None:
    """The refusals that need no torch, before importing it: a logging sink that cannot work,
    a user's folder as output_dir (rank 0, which writes there; the trainer checks both again)
    and a data.path that is not a dflash-datagen output."""
    if launch_env().rank == 0:
        check_sinks(cfg.logging)
        check_train_output_dir(cfg.output_dir)
    read_manifest(cfg.data.path)


def run(argv: list[str] | None = None) -> Path | None:
    """Train from a command line; returns the export directory (on the main process)."""
    cfg = load(argv)
    with hold_folder(cfg.output_dir, "output_dir", "dflash-train"):
        check_inputs(cfg)  # before torch: a mistake fails in a second
        from dflash_train.training.trainer import Trainer

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
