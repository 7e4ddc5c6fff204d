"""dflash-export: re-export a training checkpoint in the contract format, optionally push it.

    dflash-export runs/qwen3-8b-dflash-b16                      # latest checkpoint -> <run>/export
    dflash-export runs/x/checkpoints/step_00002000 out=drafter-2k
    dflash-export runs/x push=true repo_id=me/qwen3-8b-dflash eval_results=eval_results/results.json

Settings are key=value overrides of recipes/export.yaml; the bare path stands for path=...
The command's flags of before (--out DIR, --push, ...) are refused with their key=value form.
The checkpoint's own recipe (config.yaml) rebuilds the drafter config from the target's
config alone (no target weights are loaded). Repo id and privacy default to the recipe's
``hub`` section; the Hub token comes from huggingface_hub's environment or login only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from dflash_train.errors import run_command
from dflash_train.recipe import HINT, load_command


@dataclass
class ExportConfig:
    """The settings of dflash-export; recipes/export.yaml says what each one does."""

    path: str = field(default=MISSING, metadata={HINT: "<run output_dir or checkpoint directory>"})
    out: str | None = None
    eval_results: str | None = None
    push: bool = False
    repo_id: str | None = None
    private: bool | None = None


# The command's flags before it took key=value settings: refused, naming what replaced each.
RETIRED_FLAGS = {"--out": "out=PATH", "--eval-results": "eval_results=FILE", "--push": "push=true",
                 "--repo-id": "repo_id=USER/NAME", "--private": "private=true", "--no-private": "private=false"}


def load(argv: list[str] | None = None) -> ExportConfig:
    """The validated settings of a command line; reads nothing."""
    return load_command(ExportConfig, argv, "export", __doc__, retired=RETIRED_FLAGS, positional="path")


def main(argv: list[str] | None = None) -> None:
    run_command("dflash-export", _run, argv)


def _run(argv: list[str] | None) -> None:
    args = load(argv)
    from dflash_train.export.job import (
        export_and_push,  # torch: only once the settings are valid
    )

    export_and_push(args)


if __name__ == "__main__":
    main()
