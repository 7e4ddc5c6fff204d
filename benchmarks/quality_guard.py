"""The quality guard: a short deterministic training run held against pinned figures.

    python -m benchmarks.quality_guard --target /tmp/qwen25coder05b.gguf \\
        --data /tmp/data/sharegpt-qwen25-coder-05b --out /tmp/guard
    python -m benchmarks.quality_guard --metrics RUN/metrics.jsonl   # judge a finished run

Runs the 600-step arm of the recipe `qwen25_coder_05b_1xh100` on the shared regenerated set
(64 conversations held out, held-out expected tau every 150 steps, the schedule spanning
exactly the 600 steps), then compares held-out expected tau at steps 150..600 and the median
step time with `benchmarks/quality-guard/pinned.json`. It prints one table and PASS or FAIL:
FAIL when tau at any pinned step falls by more than 0.01, or the median step is more than 3%
slower. GPU training runs are deterministic, so the same code gives the same tau to the third
decimal and a change that moves it is a change in what the trainer computes. About 4 minutes
on one H100. Step times are compared only on the device the figures were pinned on.

Run it before landing any change to the training path (trainer, loss and its kernels, target,
data, masks, optimizer, recipes). Re-pin (`--write-pinned FILE`, then commit FILE as
`benchmarks/quality-guard/pinned.json` in a commit of its own saying why) only with a
measured improvement.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

PINNED = Path(__file__).parent / "quality-guard" / "pinned.json"
TAU_DROP = 0.01  # held-out expected tau may fall by at most this much at any pinned step
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


def median_step_seconds(lines: list[dict], warmup: int = WARMUP_LINES) -> float:
    """Median seconds per step between consecutive metric lines, after the warm-up lines.

    Intervals that hold a validation are longer; the median of the about 60 intervals of
    the arm is not moved by its four validations."""
    steps = [m for m in lines if "loss" in m][warmup:]
    rates = [(b["time"] - a["time"]) / (b["step"] - a["step"]) for a, b in zip(steps, steps[1:]) if b["step"] > a["step"]]
    if not rates:
        raise ValueError(f"{len(steps)} metric lines after the warm-up: too few to time a step")
    return statistics.median(rates)


def judge(measured: dict, pinned: dict) -> tuple[list[str], bool]:
    """Table rows and the verdict of ``measured`` against ``pinned`` (both in pinned.json's shape)."""
    rows, ok = [], True
    for step, want in sorted((int(k), v) for k, v in pinned["val_expected_tau"].items()):
        got = measured["val_expected_tau"].get(str(step))
        if got is None:
            rows.append(f"| held-out tau @ {step} | {want:.3f} | missing | - | FAIL |")
            ok = False
            continue
        bad = got < want - TAU_DROP
        ok &= not bad
        rows.append(f"| held-out tau @ {step} | {want:.3f} | {got:.3f} | {got - want:+.3f} | {'FAIL' if bad else 'ok'} |")
    want, got = pinned["median_step_s"], measured["median_step_s"]
    if want is None:
        rows.append(f"| median step (s) | not pinned | {got:.4f} | - | not compared |")
    elif measured.get("device") != pinned.get("device"):
        rows.append(f"| median step (s) | {want:.4f} | {got:.4f} | - | not compared: pinned on {pinned.get('device')}, "
                    f"measured on {measured.get('device')} |")
    else:
        bad = got > want * (1 + SLOWDOWN)
        ok &= not bad
        rows.append(f"| median step (s) | {want:.4f} | {got:.4f} | {100 * (got / want - 1):+.1f}% | "
                    f"{'FAIL' if bad else 'ok'} |")
    return rows, ok


def measure(lines: list[dict], device: str | None, commit: str | None) -> dict:
    return {"val_expected_tau": {str(k): round(v, 4) for k, v in held_out_tau(lines).items()},
            "median_step_s": round(median_step_seconds(lines), 5), "device": device, "commit": commit}


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def _device() -> str | None:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def train(args) -> Path:
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"quality guard: --out {out} is not empty; give a new folder")
    cmd = [sys.executable, "-m", "dflash_train.train", *ARM, f"target.name={args.target}", f"data.path={args.data}",
           f"output_dir={out}", *args.overrides]
    print("$", " ".join(cmd), flush=True)
    t0 = time.time()
    subprocess.run(cmd, check=True)
    print(f"trained in {time.time() - t0:.0f} s", flush=True)
    return out / "metrics.jsonl"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", help="the Qwen2.5-Coder-0.5B-Instruct GGUF (or model folder)")
    p.add_argument("--data", help="the shared regenerated set sharegpt-qwen25-coder-05b")
    p.add_argument("--out", help="a new folder for the run")
    p.add_argument("--metrics", help="judge this finished run's metrics.jsonl instead of training")
    p.add_argument("--pinned", default=str(PINNED))
    p.add_argument("--write-pinned", help="also write the measured figures here, in pinned.json's shape")
    p.add_argument("--commit", help="the commit measured (default: git's HEAD here, +dirty if changed)")
    p.add_argument("overrides", nargs="*", help="extra dflash-train overrides (an A/B arm)")
    args = p.parse_args(argv)
    if args.metrics is None and not (args.target and args.data and args.out):
        p.error("give --target, --data and --out to train, or --metrics to judge a finished run")
    metrics = Path(args.metrics) if args.metrics else train(args)
    measured = measure(read_metrics(metrics), _device(), args.commit or _git_commit())
    pinned = json.loads(Path(args.pinned).read_text())
    rows, ok = judge(measured, pinned)
    print(f"\nquality guard: measured at {measured['commit']} on {measured['device']}; "
          f"pinned at {pinned.get('commit')} on {pinned.get('device')}")
    print("| figure | pinned | measured | change | verdict |\n|---|---|---|---|---|")
    print("\n".join(rows))
    print("PASS" if ok else "FAIL")
    if args.write_pinned:
        Path(args.write_pinned).write_text(json.dumps(measured, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
