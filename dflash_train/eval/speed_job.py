"""eval.speed's work: plain and speculative tokens/s of each runtime over the same prompts,
and the static runtime's per-step breakdown.

eval/speed.py reads the command line and imports this module once the settings and inputs
passed their checks, so a mistake in them is refused without torch.
"""

from __future__ import annotations

import torch

from dflash_train.eval.acceptance import compare_prompt, summarize
from dflash_train.eval.batched import compare_batch
from dflash_train.eval.breakdown import format_breakdown, step_breakdown
from dflash_train.eval.settings import EvalConfig
from dflash_train.eval.static_batched import compare_static_batch
from dflash_train.model.runtime import static_unsupported


def batches(items: list, batch_size: int) -> list[list[tuple[str, list[int]]]]:
    """(id, token ids) rows in batches of ``batch_size``: the last filled by cycling from the
    first prompt (every batch the same shape: the static runtime captures its graphs once);
    a repeated prompt's id gets ``#k``."""
    count = -(-len(items) // batch_size) * batch_size
    rows = []
    for i in range(count):
        prompt, ids = items[i % len(items)]
        rows.append((prompt.id + (f"#{i // len(items)}" if i >= len(items) else ""), ids[0].tolist()))
    return [rows[i : i + batch_size] for i in range(0, count, batch_size)]


def _decoder(cfg: EvalConfig, drafter, model, runtime: str):
    """A batch of (id, token ids) rows -> their PromptResults, both runs on ``runtime``."""
    static = runtime == "static"
    if cfg.batch_size == 1:
        return lambda batch: [compare_prompt(drafter, model, pid, torch.tensor([ids], device=model.device),
                                             cfg.max_new_tokens, [], cfg.temperature, cfg.seed, static=static,
                                             verify_tokens=cfg.verify_tokens)
                              for pid, ids in batch]
    compare = compare_static_batch if static else compare_batch
    return lambda batch: compare(drafter, model, [pid for pid, _ in batch], [ids for _, ids in batch],
                                 cfg.max_new_tokens, [], cfg.temperature, cfg.seed, verify_tokens=cfg.verify_tokens)


def measure(cfg: EvalConfig, datasets, target, drafter, stops, tokenizer) -> dict[str, dict]:
    """runtime -> dataset summary (tokens/s, tau, agreement) of the first dataset's prompts."""
    runtimes = ["dynamic", "static"] if cfg.runtime == "auto" else [cfg.runtime]
    if cfg.runtime == "auto" and static_unsupported(target.model):
        runtimes = ["dynamic"]
    _, items = next(iter(datasets.values()))
    groups = batches(items, cfg.batch_size)
    summaries = {}
    for runtime in runtimes:
        decode = _decoder(cfg, drafter, target.model, runtime)
        decode(groups[0])  # untimed: sizes the caches, captures the graphs
        results = [r for group in groups for r in decode(group)]
        summaries[runtime] = summarize(results, drafter.config.block_size, greedy=cfg.temperature == 0)
    return summaries


def breakdown_report(cfg: EvalConfig, datasets, target, drafter, stops, tokenizer) -> str:
    """The static runtime's per-step cost table over the first dataset's prompts."""
    reason = static_unsupported(target.model)
    if reason is not None:
        return f"no step breakdown: the static runtime cannot serve this target ({reason})"
    _, items = next(iter(datasets.values()))
    return format_breakdown(step_breakdown(drafter, target.model, [ids for _, ids in items], cfg.max_new_tokens,
                                           cfg.verify_tokens))
