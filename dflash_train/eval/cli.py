"""``dflash-eval``: acceptance length, lossless check and speedup of a drafter on benchmarks.

    dflash-eval drafter_path=DIR datasets=[mtbench,humaneval] limit=20 max_new_tokens=256

Config: ``recipes/eval.yaml``. For each dataset every prompt goes through the target's
chat template, is decoded speculatively and plainly, and the two are compared. A prompt
with follow-up questions (MT-Bench's second turn) then asks each of them after the
target's own previous answer (the plain run's, greedy or sampled). Writes
``results.json`` and ``acceptance.png`` under ``output_dir`` and prints a table. Tokens/s
is new tokens over the wall time of whole generations (prefill included), summed over the
dataset's prompts; speedup is the ratio of the two rates. ``batch_size=N`` decodes N
prompts at once in both runs (throughput; 1, the default, gives latency numbers).
``runtime=static|dynamic|auto`` picks the decode loops of both runs (auto: static on a GPU).
``verify_tokens=k`` has the target verify only the first k drafts of each block (1 to
block size - 1; null, the default: all of them), as serving engines' shorter verify does.
``step_timing=true`` adds the speculative steps' draft / verify / bookkeeping time per step.
A drafter exported for other target weights than ``target.name``'s is refused (it would
reject nearly every draft); ``allow_other_target=true`` evaluates it anyway.
Settings are Hydra overrides of ``recipes/eval.yaml``: key=value, group=option (target=qwen3_8b).
"""

from __future__ import annotations

from dflash_train.errors import run_command
from dflash_train.eval.settings import EvalConfig, check_inputs, validate
from dflash_train.recipe import load_command, log_to_stdout
from dflash_train.run_lock import hold_folder


def load(argv: list[str] | None = None) -> EvalConfig:
    """The validated settings of a command line; loads nothing."""
    return load_command(EvalConfig, argv, "eval", __doc__, validate)


def run(argv: list[str] | None = None) -> dict:
    cfg = load(argv)
    with hold_folder(cfg.output_dir, "output_dir", "dflash-eval"):
        prompts = check_inputs(cfg)  # before torch: a mistake fails in a second
        from dflash_train.eval.job import evaluate, setup

        return evaluate(cfg, *setup(cfg, prompts))


def main(argv: list[str] | None = None) -> None:
    log_to_stdout()
    # A user mistake or a refusal of the machine: one readable line and a non-zero exit.
    run_command("dflash-eval", run, argv)


if __name__ == "__main__":
    main()
