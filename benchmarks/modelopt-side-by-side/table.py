"""One table of side-by-side quality runs: dflash-quality's columns, each row led by its trainer
and budget. ``python3 benchmarks/modelopt-side-by-side/table.py DIR`` reads DIR/<trainer>-<minutes>/
quality.json (run.sh's run folders: dflash-5, modelopt-5, ...), both trainers' summaries."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dflash_train.quality import table

TRAINERS = {"dflash": "dflash-train", "modelopt": "Model-Optimizer 0.47"}


def run_rows(root: Path) -> list[tuple[str, float, dict]]:
    """(trainer, budget minutes, quality.json) of each finished run under ``root``, by budget then trainer."""
    rows = []
    for path in root.glob("*-*/quality.json"):
        trainer, _, minutes = path.parent.name.rpartition("-")
        if trainer in TRAINERS:
            rows.append((TRAINERS[trainer], float(minutes), json.loads(path.read_text())))
    order = list(TRAINERS.values())
    return sorted(rows, key=lambda r: (r[1], order.index(r[0])))


def side_by_side(rows: list[tuple[str, float, dict]]) -> str:
    """A Markdown table: trainer, budget, then dflash-quality's columns of each run's summary.
    The evaluation datasets (columns) are the first run's; every run must have the same."""
    if not rows:
        return "(no finished run)"
    names = list(rows[0][2]["tau"])
    head = table(rows[0][2]).splitlines()[:2]
    lines = ["| trainer | budget min " + head[0], "|---|---" + head[1]]
    for trainer, minutes, summary in rows:
        if list(summary["tau"]) != names:
            raise ValueError(f"{trainer} at {minutes:g} min was evaluated on {list(summary['tau'])}, not {names}")
        lines.append(f"| {trainer} | {minutes:g} " + table(summary).splitlines()[2])
    return "\n".join(lines)


if __name__ == "__main__":
    print(side_by_side(run_rows(Path(sys.argv[1]))))
