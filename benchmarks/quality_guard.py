"""The quality guard: short deterministic training runs held against pinned figures, with a
threshold taken from the measured seed-to-seed noise.

    python -m benchmarks.quality_guard --target /tmp/qwen25coder05b.gguf \\
        --data /tmp/data/sharegpt-qwen25-coder-05b --out /tmp/guard [--seeds 0 1 2 --parallel 3]
    python -m benchmarks.quality_guard --metrics RUN_OR_DIR            # judge finished runs
    python -m benchmarks.quality_guard --metrics NEW_DIR --baseline OLD_DIR   # a paired A/B

Runs the 600-step arm of the recipe `qwen25_coder_05b_1xh100` on the shared regenerated set
(64 conversations held out, held-out expected tau every 150 steps, the schedule spanning
exactly the 600 steps) once per seed (`seed=S`: data order, anchors, initial weights and the
held-out rows), each into <out>/seed-S, and compares held-out expected tau at steps
150..600 with `benchmarks/quality-guard/pinned.json`, seed by seed. The held-out tau counted
block by block (`val_tau`, each block's accepted run) is printed beside it, against the
reference where that holds it, and not judged: the pin, the seed-to-seed spread and the
thresholds are the expected tau's (`val_expected_tau`).

Why a noise threshold: a GPU run is deterministic on one machine, so unchanged arithmetic
gives the pinned figures to the fourth decimal, but any change in rounding (a new kernel,
a fused op, another host) moves a run as far as another seed does. Three seeds of one arm
spread by 0.02-0.05 at step 600 on one H100 (benchmarks/guard-noise-h100-2026-11-26). So at
each step the guard takes the mean over the measured seeds of (measured - pinned) of the same
seed and says FAIL when it falls below -Z * sd * sqrt(2 / n): the pinned pooled seed-to-seed
standard deviation `sd` of that step, n seeds, Z = 2. One seed detects a fall of about 0.05 at
step 600, three seeds about 0.03 (the table prints each step's threshold). `--baseline`
judges the same way against another finished set of runs (a paired A/B in one lease, which
also takes the host out of the comparison). The median step may be at most 3% slower, compared
only for one run at a time on the pinned device (runs that share a GPU time each other).

Run it before landing any change to the training path (trainer, loss and its kernels, target,
data, masks, optimizer, recipes). Re-pin (`--write-pinned FILE`, then commit FILE as
`benchmarks/quality-guard/pinned.json` in a commit of its own saying why) only with a
measured improvement or a recipe change, on the seeds the pin holds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dflash_train.console import command_lines, note_lines

PINNED = Path(__file__).parent / "quality-guard" / "pinned.json"
Z = 2.0  # the threshold in standard deviations of a mean paired difference
SLOWDOWN = 0.03  # the median step may be at most this much slower
WARMUP_LINES = 2  # metric lines whose intervals include compilation
STEPS = 600
ARM = ["+experiment=qwen25_coder_05b_1xh100", "epochs=1000", f"max_steps={STEPS}", f"optim.schedule_steps={STEPS}",
       "data.val_rows=64", "data.val_every=150", "logging.wandb=disabled", "logging.progress_bar=false",
       "logging.every=10", "checkpoint.every=0", "export=false"]


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def held_out_tau(lines: list[dict]) -> dict[int, float]:
    """{step: held-out expected tau} of every validation in the run."""
    return {m["step"]: m["val_expected_tau"] for m in lines if "val_expected_tau" in m}


def held_out_block_tau(lines: list[dict]) -> dict[int, float]:
    """{step: held-out tau counted block by block (val_tau)} of every validation that has it."""
    return {m["step"]: m["val_tau"] for m in lines if "val_tau" in m}


def median_step_seconds(lines: list[dict], warmup: int = WARMUP_LINES) -> float:
    """Median seconds per step between consecutive metric lines, after the warm-up lines.

    Intervals that hold a validation are longer; the median of the about 60 intervals of
    the arm is not moved by its four validations."""
    steps = [m for m in lines if "loss" in m][warmup:]
    rates = [(b["time"] - a["time"]) / (b["step"] - a["step"]) for a, b in zip(steps, steps[1:]) if b["step"] > a["step"]]
    if not rates:
        raise ValueError(f"{len(steps)} metric lines after the warm-up: too few to time a step")
    return statistics.median(rates)


def seed_runs(path: Path) -> dict[int, Path]:
    """{seed: metrics.jsonl} of a guard's --out folder (seed-S/), or one run's file or folder (seed 0)."""
    if path.is_file():
        return {0: path}
    runs = {int(d.name.removeprefix("seed-")): d / "metrics.jsonl" for d in path.glob("seed-*")
            if (d / "metrics.jsonl").exists()}
    if not runs and (path / "metrics.jsonl").exists():
        runs = {0: path / "metrics.jsonl"}
    if not runs:
        raise SystemExit(f"quality guard: no metrics.jsonl in {path} or its seed-*/ folders")
    return runs


def measure(runs: dict[int, list[dict]], device: str | None, commit: str | None, parallel: int = 1) -> dict:
    """pinned.json's shape: held-out tau by seed and step, the median step of the runs, and the
    held-out tau counted block by block by seed and step where the runs logged it (reported)."""
    return {"seeds": {str(s): {str(k): round(v, 4) for k, v in held_out_tau(lines).items()}
                      for s, lines in sorted(runs.items())},
            "block_tau": {str(s): {str(k): round(v, 4) for k, v in held_out_block_tau(lines).items()}
                          for s, lines in sorted(runs.items()) if held_out_block_tau(lines)},
            "median_step_s": round(statistics.median(median_step_seconds(lines) for lines in runs.values()), 5),
            "parallel": parallel, "device": device, "commit": commit}


def pooled_sd(arms: list[dict[str, dict[str, float]]]) -> dict[str, float]:
    """{step: pooled seed-to-seed standard deviation} over arms of several seeds each (every
    arm's own mean removed, so arms that differ in mean do not widen it)."""
    steps = sorted({k for arm in arms for taus in arm.values() for k in taus}, key=int)
    out = {}
    for step in steps:
        groups = [[taus[step] for taus in arm.values() if step in taus] for arm in arms]
        groups = [g for g in groups if len(g) > 1]
        dof = sum(len(g) - 1 for g in groups)
        if dof:
            out[step] = round(math.sqrt(sum(statistics.variance(g) * (len(g) - 1) for g in groups) / dof), 4)
    return out


def threshold(sd: float, n: int) -> float:
    """The largest fall of the mean paired difference over n seeds that noise explains."""
    return Z * sd * math.sqrt(2 / n)


def judge(measured: dict, reference: dict, sd: dict[str, float]) -> tuple[list[str], bool]:
    """Table rows and the verdict of ``measured`` against ``reference`` (both in pinned.json's
    shape), seed by seed on the seeds both hold."""
    seeds = sorted(set(measured["seeds"]) & set(reference["seeds"]), key=int)
    if not seeds:
        return [f"| seeds | {', '.join(reference['seeds'])} | {', '.join(measured['seeds'])} | - | "
                "FAIL: no seed in common |"], False
    rows, ok = [], True
    for step in sorted(sd, key=int):
        pairs = [(reference["seeds"][s].get(step), measured["seeds"][s].get(step)) for s in seeds]
        if any(None in pair for pair in pairs):
            rows.append(f"| held-out tau @ {step} | - | missing | - | - | FAIL |")
            ok = False
            continue
        want, got = statistics.mean(p[0] for p in pairs), statistics.mean(p[1] for p in pairs)
        change = got - want
        limit = threshold(sd[step], len(seeds))
        bad = change < -limit
        ok &= not bad
        rows.append(f"| held-out tau @ {step} | {want:.3f} | {got:.3f} | {change:+.3f} | -{limit:.3f} | "
                    f"{'FAIL' if bad else 'ok'} |")
    rows.append(_step_row(measured, reference))
    ok &= "FAIL" not in rows[-1]
    return rows, ok


def reported_rows(measured: dict, reference: dict) -> list[str]:
    """Table rows of held-out tau counted block by block (val_tau), the mean over the measured
    seeds at each step, beside the reference's mean over the same seeds where it holds them.
    Reported, never judged: the pin and the noise thresholds are those of the expected tau."""
    got, ref = measured.get("block_tau", {}), reference.get("block_tau", {})
    rows = []
    for step in sorted({k for taus in got.values() for k in taus}, key=int):
        seeds = [s for s, taus in got.items() if step in taus]
        mean = statistics.mean(got[s][step] for s in seeds)
        want = [ref[s][step] for s in seeds if step in ref.get(s, {})]
        if len(want) == len(seeds):
            ref_mean = statistics.mean(want)
            rows.append(f"| held-out tau (blocks) @ {step} | {ref_mean:.3f} | {mean:.3f} | {mean - ref_mean:+.3f} | "
                        "- | reported |")
        else:
            rows.append(f"| held-out tau (blocks) @ {step} | - | {mean:.3f} | - | - | reported |")
    return rows


def _step_row(measured: dict, reference: dict) -> str:
    want, got = reference.get("median_step_s"), measured["median_step_s"]
    head = f"| median step (s) | {'-' if want is None else f'{want:.4f}'} | {got:.4f} |"
    if want is None:
        return f"{head} - | - | not compared: none pinned |"
    if measured.get("device") != reference.get("device"):
        return f"{head} - | - | not compared: pinned on {reference.get('device')}, measured on {measured.get('device')} |"
    if max(measured.get("parallel", 1), reference.get("parallel", 1)) > 1:
        return f"{head} - | - | not compared: runs shared the GPU |"
    bad = got > want * (1 + SLOWDOWN)
    return f"{head} {100 * (got / want - 1):+.1f}% | +{100 * SLOWDOWN:.0f}% | {'FAIL' if bad else 'ok'} |"


def _git_commit() -> str | None:
    """HEAD (+dirty), or DFLASH_COMMIT where there is no git: a lease's copy of the checkout has
    no .git, and benchmarks/gpu/setup.sh exports the commit prepare.sh built the wheel from."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("DFLASH_COMMIT") or None


def _device() -> str | None:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def train(args) -> Path:
    """Every seed's run into <out>/seed-S (its log beside it), ``--parallel`` at a time."""
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"quality guard: --out {out} is not empty; give a new folder")
    out.mkdir(parents=True, exist_ok=True)
    todo, running, failed, t0 = list(args.seeds), [], [], time.time()
    while todo or running:
        while todo and len(running) < args.parallel:
            seed = todo.pop(0)
            cmd = [sys.executable, "-m", "dflash_train.train", *ARM, f"target.name={args.target}",
                   f"data.path={args.data}", f"output_dir={out / f'seed-{seed}'}", f"seed={seed}", *args.overrides]
            print(command_lines("$", cmd), flush=True)
            log = open(out / f"seed-{seed}.log", "w")
            running.append((seed, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
        time.sleep(2)
        for item in [r for r in running if r[1].poll() is not None]:
            running.remove(item)
            seed, proc, log = item
            log.close()
            if proc.returncode:  # the other seeds run on: what they measure is kept
                failed.append((seed, proc.returncode, Path(log.name)))
                print(f"seed {seed} failed (exit {proc.returncode}); its log's last lines:", flush=True)
                print(log_tail(Path(log.name)), flush=True)
                continue
            print(f"seed {seed} trained ({time.time() - t0:.0f} s since the start)", flush=True)
    if failed:
        raise SystemExit("quality guard: " + "; ".join(f"seed {s} failed (exit {rc}), see {p}" for s, rc, p in failed))
    return out


def log_tail(path: Path, lines: int = 15, width: int = 240) -> str:
    """The last lines of a run's log, each cut to ``width`` (progress bars rewrite one line)."""
    text = path.read_text(errors="replace").replace("\r", "\n").splitlines()
    return "\n".join("    " + line[:width] for line in text[-lines:])


def _load(path: Path) -> dict[int, list[dict]]:
    return {s: read_metrics(p) for s, p in seed_runs(path).items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", help="the Qwen2.5-Coder-0.5B-Instruct GGUF (or model folder)")
    p.add_argument("--data", help="the shared regenerated set sharegpt-qwen25-coder-05b")
    p.add_argument("--out", help="a new folder for the runs (seed-S/ each)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds to run (the pin holds 0 1 2)")
    p.add_argument("--parallel", type=int, default=1, help="runs at a time on the GPU (3 fit an 80 GB H100)")
    p.add_argument("--metrics", help="judge these finished runs (a guard --out folder, a run folder or its "
                                     "metrics.jsonl) instead of training")
    p.add_argument("--baseline", help="judge against these finished runs (same seeds) instead of the pin")
    p.add_argument("--pinned", default=str(PINNED))
    p.add_argument("--write-pinned", help="also write the measured figures here, in pinned.json's shape")
    p.add_argument("--commit", help="the commit measured (default: git's HEAD here, +dirty if changed)")
    p.add_argument("overrides", nargs="*", help="extra dflash-train overrides (an A/B arm)")
    args = p.parse_args(argv)
    if args.metrics is None and not (args.target and args.data and args.out):
        p.error("give --target, --data and --out to train, or --metrics to judge finished runs")
    if args.parallel < 1:
        p.error(f"--parallel {args.parallel}: must be >= 1")
    runs = _load(Path(args.metrics) if args.metrics else train(args))
    parallel = 1 if args.metrics else args.parallel
    measured = measure(runs, _device(), args.commit or _git_commit(), parallel)
    pinned = json.loads(Path(args.pinned).read_text())
    reference = pinned if args.baseline is None else measure(_load(Path(args.baseline)), measured["device"],
                                                             "baseline", parallel)
    rows, ok = judge(measured, reference, pinned["seed_sd"])
    against = f"the pin of {pinned.get('commit')} on {pinned.get('device')}" if args.baseline is None else args.baseline
    print("\n" + "\n".join(note_lines(f"quality guard: measured at {measured['commit']} on {measured['device']}, "
                                     f"seeds {', '.join(measured['seeds'])}; against {against}")))
    print("| figure | reference | measured | change | noise threshold | verdict |\n|---|---|---|---|---|---|")
    print("\n".join(rows + reported_rows(measured, reference)))
    print("PASS" if ok else "FAIL")
    if args.write_pinned:
        Path(args.write_pinned).write_text(json.dumps({**measured, "seed_sd": pinned["seed_sd"]}, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
