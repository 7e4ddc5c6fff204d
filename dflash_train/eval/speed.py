"""Plain and speculative tokens/s per runtime, at batch 1 (latency) or ``batch_size=N``.

    python -m dflash_train.eval.speed target=qwen25_coder_05b device=cuda drafter_path=random \
        max_new_tokens=256 limit=10

``batch_size=N`` decodes N prompts per step in both runs of a runtime (speculative and plain
batched decoding on the same runtime; ``runtime=static``: eval/static_batched.py, each step
of the batch a CUDA graph on a GPU), so the speedup is over plain batched decoding at that
batch size. The first ``limit`` prompts are cut into batches of N, the last batch filled
by repeating prompts from the first, so every batch has N rows.

The config is ``dflash-eval``'s (``recipes/eval.yaml``): the first ``limit`` prompts of the
first dataset are decoded speculatively and plainly with each runtime (``runtime=auto``
measures both, ``static`` or ``dynamic`` one), every generation exactly ``max_new_tokens``
long (stop tokens are ignored, so each prompt costs the same work in every run). Each
runtime first decodes one batch untimed, which sizes its caches and captures its CUDA
graphs. A random drafter (tau near 1) measures the runtime's overhead: its speedup is the
floor a trained drafter's acceptance multiplies.

``verify_tokens=k`` (as in ``dflash-eval``): every runtime's target verifies the first k
drafts of each block.

``step_timing=true`` then prints where a speculative step of the static runtime spends its
time over the same prompts: draft, verify, acceptance, the host's wait for the device and
bookkeeping, in host and (CUDA events) device milliseconds, with the ops, kernels and
launch calls of each part (torch.profiler), against the plain static step
(eval/breakdown.py says what each column measures), at batch 1 whatever ``batch_size``.
"""

from __future__ import annotations

from dflash_train.console import note_lines
from dflash_train.errors import run_command
from dflash_train.eval.settings import EvalConfig, check_inputs, validate
from dflash_train.model.runtime_checks import check_verify_tokens
from dflash_train.recipe import load_command


def format_speed_table(summaries: dict[str, dict]) -> str:
    header = f"{'runtime':<8} {'n':>4} {'tau':>6} {'plain tok/s':>12} {'spec tok/s':>11} {'speedup':>8} {'agree %':>8}"
    rows = [header, "-" * len(header)]
    for runtime, s in summaries.items():
        agree = "-" if s["greedy_agreement"] is None else f"{100 * s['greedy_agreement']:.1f}"
        rows.append(f"{runtime:<8} {s['num_prompts']:>4} {s['tau']:>6.2f} {s['plain_tok_s']:>12.1f} "
                    f"{s['spec_tok_s']:>11.1f} {s['speedup']:>7.2f}x {agree:>8}")
    return "\n".join(rows)


def validate_speed(cfg: EvalConfig) -> None:
    validate(cfg, static_batches=True)
    if cfg.step_timing and cfg.max_new_tokens < 2:
        raise ValueError(f"step_timing=true needs max_new_tokens >= 2, got {cfg.max_new_tokens}: the breakdown "
                         "times the decode steps after the first token")


def load(argv: list[str] | None = None) -> EvalConfig:
    """The validated settings of a command line; loads nothing."""
    return load_command(EvalConfig, argv, "eval", __doc__, validate_speed)


def run(argv: list[str] | None = None) -> dict[str, dict]:
    cfg = load(argv)
    prompts = check_inputs(cfg)  # before torch: a mistake fails in a second
    from dflash_train.eval.job import setup
    from dflash_train.eval.speed_job import breakdown_report, measure

    loaded = setup(cfg, prompts)
    summaries = measure(cfg, *loaded)
    verify = check_verify_tokens(cfg.verify_tokens, loaded[2].block_size)
    print("\n".join(note_lines(f"{cfg.target.name} on {cfg.device} ({cfg.dtype}), batch {cfg.batch_size}, "
                               f"{cfg.max_new_tokens} new tokens, drafter {cfg.drafter_path}, "
                               f"{verify} drafts verified per step")))
    print(format_speed_table(summaries))
    if cfg.step_timing:
        print(breakdown_report(cfg, *loaded))
    return summaries


def main(argv: list[str] | None = None) -> None:
    run_command("dflash-speed", run, argv)


if __name__ == "__main__":
    main()
