"""The acceptance plot: per-position acceptance rate and the step-length histogram."""

from __future__ import annotations

from pathlib import Path


def plot_acceptance(summaries: dict[str, dict], path: str | Path, title: str = "") -> Path:
    """One line per dataset; ``summaries`` maps label -> ``acceptance.summarize`` output."""
    # Figure without pyplot: no global backend state, works on headless machines.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4), layout="constrained")
    rate_ax, hist_ax = fig.subplots(1, 2)
    for label, s in summaries.items():
        rates = s["position_acceptance"]
        rate_ax.plot(range(1, len(rates) + 1), rates, marker="o", label=f"{label} (tau {s['tau']:.2f})")
        hist = s["length_histogram"]
        steps = max(sum(hist), 1)
        hist_ax.plot(range(1, len(hist) + 1), [c / steps for c in hist], marker="o", label=label)
    rate_ax.set(xlabel="draft position k", ylabel="P(accepted drafts >= k)", ylim=(0, 1.02),
                title="Per-position acceptance")
    hist_ax.set(xlabel="acceptance length (accepted drafts + 1)", ylabel="fraction of steps", ylim=(0, 1.02),
                title="Acceptance length histogram")
    for ax in (rate_ax, hist_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path
