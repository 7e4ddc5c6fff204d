"""The table ``dflash-eval`` prints, from the per-dataset summaries of eval/acceptance.py.

It lives apart from the command so that the model card (export/hub.py) rebuilds it from a
results.json without importing the eval command.
"""

from __future__ import annotations

from dflash_train.eval.acceptance import NEAR_TIE_ULPS


def format_table(summaries: dict[str, dict]) -> str:
    """One row per dataset; agreement is '-' when sampling (no lossless check applies).

    Below it: tau per turn for multi-turn datasets, the per-step time split when timed,
    and one line per dataset whose outputs diverged from plain decoding.
    """
    w = max(7, *(len(label) for label in summaries))
    header = f"{'dataset':<{w}} {'n':>4} {'tau':>6} {'agree %':>8} {'spec tok/s':>11} {'plain tok/s':>12} {'speedup':>8}"
    rows = [header, "-" * len(header)]
    for label, s in summaries.items():
        agree = "-" if s["greedy_agreement"] is None else f"{100 * s['greedy_agreement']:.1f}"
        rows.append(f"{label:<{w}} {s['num_prompts']:>4} {s['tau']:>6.2f} {agree:>8} {s['spec_tok_s']:>11.1f} "
                    f"{s['plain_tok_s']:>12.1f} {s['speedup']:>7.2f}x")
    rows += _footnotes(summaries)
    for label, s in summaries.items():
        diverged, ties = s.get("divergent_prompts"), s.get("near_tie_divergences")
        if diverged:
            verdict = "rounding (bf16 ties), not a bug" if ties == diverged else \
                f"{diverged - ties} not (a clear gap or a length difference): a lossless runtime never does that"
            rows.append(f"{label}: {diverged} prompt(s) diverged from plain decoding, {ties} at a near-tie "
                        f"(top-2 gap <= {NEAR_TIE_ULPS:g} rounding steps): {verdict}")
    return "\n".join(rows)


def _footnotes(summaries: dict[str, dict]) -> list[str]:
    rows = []
    for label, s in summaries.items():
        by_turn = s.get("tau_by_turn") or {}
        if len(by_turn) > 1:
            rows.append(f"{label}: tau by turn " + ", ".join(f"{t}: {v:.2f}" for t, v in by_turn.items()))
        if s["greedy_agreement"] is None:
            rows.append(f"{label}: sampled (temperature {s.get('temperature', '>0')}): tau is acceptance under "
                        "rejection sampling; agreement with plain decoding does not apply (two draws of the "
                        "same distribution differ)")
    runtimes = sorted({s["runtime"] for s in summaries.values() if "runtime" in s})
    if runtimes:
        rows.append(f"runtime: {', '.join(runtimes)} (both runs; static: preallocated caches, captured CUDA graphs "
                    "on a GPU)")
    batched = {s.get("batch_size", 1) for s in summaries.values()} - {1}
    if batched:
        rows.append(f"batch_size={max(batched)}: tok/s is the batches' throughput (new tokens over the batches' "
                    "wall time, a batch's time split evenly over its rows, which may mix datasets); batch_size=1 gives "
                    "the per-prompt latency numbers")
    timed = {label: s["step_times"]["ms_per_step"] for label, s in summaries.items() if s.get("step_times")}
    if timed:
        w = max(7, *(len(label) for label in timed))
        rows.append(f"{'ms/step':<{w}} {'draft':>8} {'verify':>8} {'bookkeep':>9}")
        rows += [f"{label:<{w}} {t['draft']:>8.2f} {t['verify']:>8.2f} {t['bookkeeping']:>9.2f}"
                 for label, t in timed.items()]
    return rows
