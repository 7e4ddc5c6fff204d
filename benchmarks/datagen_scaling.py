"""The table of benchmarks/datagen_two_gpu.sh: dflash-datagen on one GPU against torchrun on two.

    python -m benchmarks.datagen_scaling DIR [--exact]

DIR/gpus-N is the out_dir of the run on N GPUs, DIR/gpus-N.log its output, DIR/gpus-N.t0 and
.t1 the seconds since the epoch at its start and end. A run's row: prompts and rows
(manifest.json), generated tokens (its shards' records, every rank's), wall seconds (t0 to t1:
loading and magpie writing included), answer seconds (the slowest rank's "generated this run ...
over S s" in its summary: the answering stage each rank timed) and tokens/s (generated tokens over
answer seconds); scaling: tokens/s over N times one GPU's (wall scaling: the same over wall
seconds). The check line: every prompt id in exactly one shard of each run, and how many rows of
each run have the one-GPU run's input_ids (by prompt_id; bf16 on GPUs may change a few).

Exit status 1 when a finished run has a prompt id not exactly once, or, with --exact (float32 on
CPU, where every row must be equal), when a run did not finish or a row differs.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from dflash_train.data.format import load_generated, read_manifest, read_shard_meta

GPUS = (1, 2)
# the summary line each rank prints (data_gen/cli.py format_summary)
SUMMARY = re.compile(r"generated this run\s+(\d+)\s+\([\d.]+ tok/s over ([\d.]+) s\)")
# and the line after it: the rank's seconds to its prompts (of them writing magpie prompts), to
# its answering generator, writing its shards, and loading the target (a summary before 67c9023
# has no shard seconds, one before 84bdf06 no magpie or load seconds)
PHASES = re.compile(r"prompts ready after ([\d.]+) (?:\(magpie prompts written in ([\d.]+)\))?.*?"
                    r"answering generator built in ([\d.]+)(?:,\s+shards written in ([\d.]+))?"
                    r"(?: \(of the [\d.]+\), the target loaded in ([\d.]+))?")
TARGET_SPEEDUP = 1.9  # issue 39 item 4: two GPUs at least 1.9x one GPU's tokens/s


@dataclass
class Run:
    gpus: int
    prompts: int
    rows: int
    generated: int
    wall_s: float
    rank_s: list[float]  # each rank's answering seconds, as its summary printed them
    phases: list[tuple]  # each rank's (prompts ready, magpie, generator built, shards written, target loaded)
    # seconds (None: not in its summary)
    shard_ids: list[str]  # the prompt ids of every shard, in shard order
    shards_by_rank: dict[int, int]
    input_ids: dict[str, list[int]]  # a row's input_ids by its prompt_id

    @property
    def answer_s(self) -> float:
        return max(self.rank_s)

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.answer_s

    @property
    def once(self) -> bool:
        """Every usable prompt in exactly one shard, and no prompt id twice among the rows."""
        return len(set(self.shard_ids)) == len(self.shard_ids) == self.prompts and len(self.input_ids) == self.rows


def state(root: Path, gpus: int) -> str:
    """'finished', 'failed', 'running N s' or 'not started'."""
    t0, t1, log = (root / f"gpus-{gpus}{ext}" for ext in (".t0", ".t1", ".log"))
    if not t0.exists():
        return "not started"
    if not t1.exists():
        return f"running {int(time.time() - float(t0.read_text()))} s"
    finished = (root / f"gpus-{gpus}" / "manifest.json").exists() and \
        len(SUMMARY.findall(log.read_text(errors="replace"))) == gpus
    return "finished" if finished else "failed"


def read_run(root: Path, gpus: int) -> Run:
    """A finished run's figures."""
    out = root / f"gpus-{gpus}"
    manifest = read_manifest(out)
    metas = [read_shard_meta(out, k) for k in range(manifest["num_shards"])]
    data = load_generated(out)
    wall = float((root / f"gpus-{gpus}.t1").read_text()) - float((root / f"gpus-{gpus}.t0").read_text())
    log = (root / f"gpus-{gpus}.log").read_text(errors="replace")
    rank_s = [float(s) for _, s in SUMMARY.findall(log)]
    phases = [tuple(float(x) if x else None for x in found) for found in PHASES.findall(log)]
    return Run(gpus, manifest["counts"]["prompts"], manifest["counts"]["rows"],
               sum(m["generated_tokens"] for m in metas), wall, rank_s, phases,
               [p for m in metas for p in m["prompt_ids"]], dict(sorted(Counter(m["rank"] for m in metas).items())),
               dict(zip(data["prompt_id"], data["input_ids"])))


def equal_rows(run: Run, reference: Run) -> int:
    """How many of the reference's rows ``run`` has with the same input_ids."""
    return sum(run.input_ids.get(p) == ids for p, ids in reference.input_ids.items())


def table(root: Path) -> tuple[list[str], bool, bool]:
    """The table's lines, whether every finished run had each prompt once, whether every run
    finished with every row equal to the one-GPU run's."""
    states = {n: state(root, n) for n in GPUS}
    runs = {n: read_run(root, n) for n in GPUS if states[n] == "finished"}
    base = runs.get(1)
    lines = ["| GPUs | prompts | rows | generated tokens | wall s | answer s | tokens/s | scaling | wall scaling |",
             "|---|---|---|---|---|---|---|---|---|"]
    for n in GPUS:
        if n not in runs:
            lines.append(f"| {n} | {states[n]} |")
            continue
        r = runs[n]
        scale, wall_scale = ((f"{r.tokens_per_s / (n * base.tokens_per_s):.1%}",
                              f"{r.generated / r.wall_s / (n * base.generated / base.wall_s):.1%}")
                             if base and n > 1 else ("", ""))
        lines.append(f"| {n} | {r.prompts} | {r.rows} | {r.generated} | {r.wall_s:.0f} | {r.answer_s:.1f} | "
                     f"{r.tokens_per_s:.1f} | {scale} | {wall_scale} |")
    lines.append("")
    for r in runs.values():
        ranks = ", ".join(f"rank {k} {v}" for k, v in r.shards_by_rank.items())
        phases = "; ".join(f"prompts ready after {ready:.1f} s" + ("" if magpie is None else f" (magpie {magpie:.1f} s)")
                           + f", generator built in {built:.1f} s"
                           + ("" if written is None else f", shards written in {written:.1f} s")
                           + ("" if load is None else f", target loaded in {load:.1f} s")
                           for ready, magpie, built, written, load in r.phases)
        lines.append(f"{r.gpus} GPU(s): ranks' answer seconds {', '.join(f'{s:.1f}' for s in r.rank_s)}; "
                     f"shards by rank: {ranks}" + (f"; by process: {phases}" if phases else ""))
    two = runs.get(2)
    if base and two:
        speedup = two.tokens_per_s / base.tokens_per_s
        lines.append(f"2 GPUs: {speedup:.2f}x one GPU's tokens/s (target {TARGET_SPEEDUP}x: "
                     f"{'met' if speedup >= TARGET_SPEEDUP else 'not met'})")
    once = all(r.once for r in runs.values())
    equal = len(runs) == len(GPUS) and all(equal_rows(r, base) == base.rows == r.rows for r in runs.values())
    checks = [f"{r.gpus} GPU(s) {'yes' if r.once else 'NO'} ({len(set(r.shard_ids))} distinct of {len(r.shard_ids)} "
              f"ids in the shards, {r.prompts} prompts)" for r in runs.values()]
    same = f"; rows equal to the 1-GPU run's: {equal_rows(two, base)} of {base.rows}" if base and two else ""
    lines.append(f"check: every prompt id exactly once: {', '.join(checks) or 'no run finished'}{same}")
    return lines, once, equal


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", type=Path, help="the folder datagen_two_gpu.sh writes")
    p.add_argument("--exact", action="store_true", help="fail unless both runs finished with every row equal")
    args = p.parse_args(argv)
    lines, once, equal = table(args.dir)
    print("\n".join(lines))
    if not once:
        print("datagen_scaling: a prompt id is missing or repeated", file=sys.stderr)
    if args.exact and not equal:
        print("datagen_scaling: --exact: not every run finished with the one-GPU run's rows", file=sys.stderr)
    return 0 if once and (equal or not args.exact) else 1


if __name__ == "__main__":
    sys.exit(main())
