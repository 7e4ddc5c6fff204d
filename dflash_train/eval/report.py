"""The table ``dflash-eval`` prints, from the per-dataset summaries of eval/acceptance.py.

It lives apart from the command so that the model card (model/card.py, written by the trainer
and dflash-export) gets it from a results.json without importing the eval command.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash_train.console import note_lines
from dflash_train.eval.acceptance import NEAR_TIE_ULPS

# The GPU figure a CPU's speedup is shown beside: benchmarks/runtime-h100-2026-11-25 (each graph
# of the static runtime timed on one H100, Qwen2.5-Coder-0.5B in bf16, commit fc18e9f; the
# measured speedup at commit d7893bb).
GPU_FIGURE = ("on one H100 (Qwen2.5-Coder-0.5B in bf16, batch 1, static runtime; benchmarks/runtime-h100-2026-11-25, commit "
              "fc18e9f) a speculative step costs 1.74 plain steps, 1.51 with compile_drafter=true, so the "
              "speedup there is about 0.66 x tau (0.69x measured at tau 1.27 without it)")


def cpu_speedup_note(measured: dict[str, tuple[float, float]], batch_size: int = 1) -> str:
    """The sentence a CPU's speedups are printed in. measured: label -> (tau, speedup)."""
    shown = ", ".join(f"{label} {speedup:.2f}x at tau {tau:.2f} (a speculative step = {tau / speedup:.1f} "
                      f"plain steps)" for label, (tau, speedup) in measured.items())
    batch = "" if batch_size == 1 else f" (batch of {batch_size})"
    return (f"speedup on this CPU{batch}: {shown}. The speedup of speculative decoding comes from a GPU, where "
            f"verifying a whole block costs about one plain step; {GPU_FIGURE}.")


def on_cpu(summaries: dict[str, dict]) -> bool:
    """Every dataset was decoded on a CPU (results without a device, from before, count as not)."""
    return all(str(s.get("device", "")).startswith("cpu") for s in summaries.values())


def results_table(results_path: str | Path | None) -> str | None:
    """The table dflash-eval printed, rebuilt from its results.json (None: no results given)."""
    if not results_path:
        return None
    report = json.loads(Path(results_path).read_text())
    summaries = {label: {k: v for k, v in d.items() if k != "prompts"} for label, d in report["datasets"].items()}
    return format_table(summaries)


def format_table(summaries: dict[str, dict]) -> str:
    """One row per dataset; agreement is '-' when sampling (no lossless check applies).

    Below it: tau per turn for multi-turn datasets, the per-step time split when timed,
    and one line per dataset whose outputs diverged from plain decoding. On a CPU the
    speedup is not a column: it is given in a sentence beside the GPU figure.
    """
    cpu = on_cpu(summaries)
    w = max(7, *(len(label) for label in summaries))
    header = f"{'dataset':<{w}} {'n':>4} {'tau':>6} {'agree %':>8} {'spec tok/s':>11} {'plain tok/s':>12}"
    header += "" if cpu else f" {'speedup':>8}"
    rows = [header, "-" * len(header)]
    for label, s in summaries.items():
        agree = "-" if s["greedy_agreement"] is None else f"{100 * s['greedy_agreement']:.1f}"
        rows.append(f"{label:<{w}} {s['num_prompts']:>4} {s['tau']:>6.2f} {agree:>8} {s['spec_tok_s']:>11.1f} "
                    f"{s['plain_tok_s']:>12.1f}" + ("" if cpu else f" {s['speedup']:>7.2f}x"))
    if cpu:
        batch = max(s.get("batch_size", 1) for s in summaries.values())
        rows += note_lines(cpu_speedup_note({label: (s["tau"], s["speedup"]) for label, s in summaries.items()}, batch))
    rows += _footnotes(summaries)
    for label, s in summaries.items():
        diverged, ties = s.get("divergent_prompts"), s.get("near_tie_divergences")
        if diverged:
            verdict = "rounding (bf16 ties), not a bug" if ties == diverged else \
                f"{diverged - ties} not (a clear gap or a length difference): a lossless runtime never does that"
            rows += note_lines(f"{label}: {diverged} prompt(s) diverged from plain decoding, {ties} at a near-tie "
                               f"(top-2 gap <= {NEAR_TIE_ULPS:g} rounding steps): {verdict}")
    return "\n".join(rows)


def _footnotes(summaries: dict[str, dict]) -> list[str]:
    rows = []
    for label, s in summaries.items():
        by_turn = s.get("tau_by_turn") or {}
        if len(by_turn) > 1:
            rows.append(f"{label}: tau by turn " + ", ".join(f"{t}: {v:.2f}" for t, v in by_turn.items()))
        if s["greedy_agreement"] is None:
            rows += note_lines(f"{label}: sampled (temperature {s.get('temperature', '>0')}): tau is acceptance "
                               "under rejection sampling; agreement with plain decoding does not apply (two draws "
                               "of the same distribution differ)")
    runtimes = sorted({s["runtime"] for s in summaries.values() if "runtime" in s})
    if runtimes:
        rows += note_lines(f"runtime: {', '.join(runtimes)} (both runs; static: preallocated caches, captured "
                           "CUDA graphs on a GPU)")
    batched = {s.get("batch_size", 1) for s in summaries.values()} - {1}
    if batched:
        rows += note_lines(f"batch_size={max(batched)}: tok/s is the batches' throughput (new tokens over the "
                           "batches' wall time, a batch's time split evenly over its rows, which may mix datasets); "
                           "batch_size=1 gives the per-prompt latency numbers")
    timed = {label: s["step_times"]["ms_per_step"] for label, s in summaries.items() if s.get("step_times")}
    if timed:
        w = max(7, *(len(label) for label in timed))
        rows.append(f"{'ms/step':<{w}} {'draft':>8} {'verify':>8} {'bookkeep':>9}")
        rows += [f"{label:<{w}} {t['draft']:>8.2f} {t['verify']:>8.2f} {t['bookkeeping']:>9.2f}"
                 for label, t in timed.items()]
    return rows
