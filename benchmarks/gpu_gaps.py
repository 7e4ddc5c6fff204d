"""Where a training step leaves the GPU idle: runs ``dflash_train.bench`` with the given
arguments, then profiles three more steps and prints the device's busy and idle time and its
longest gaps between kernels, each with the Python frames that launched the kernel after it.

    python benchmarks/gpu_gaps.py +experiment=qwen3_8b_8xh100 backend=single optim.grad_accum_steps=1 \
        --random-target --steps 8 --warmup 3 [--trace trace.json.gz]

A gap whose next kernel was launched just before it ran means the host was late (Python,
a lock, a sync); a gap with an early launch means the device waited on something else.
"""

from __future__ import annotations

import bisect
import gzip
import json
import os
import shutil
import sys
import tempfile

import torch

from dflash_train import bench

STEPS = 3
MIN_GAP_US = 50.0


def _python_stack(frames: list[tuple[float, float, str]], starts: list[float], ts: float, depth: int = 4) -> str:
    """The innermost ``depth`` Python frames (of this repository or torch) open at ``ts``."""
    i = bisect.bisect_right(starts, ts)
    open_ = [name for start, end, name in frames[max(0, i - 4000):i] if start <= ts <= end]
    useful = [n for n in open_ if "dflash_train" in n or "transformers" in n]
    return " < ".join(reversed(useful[-depth:])) or (open_[-1] if open_ else "?")


def analyse(events: list[dict], rows: int = 15) -> str:
    kernels = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"], e.get("args", {}).get("correlation"))
                     for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    launches = {e.get("args", {}).get("correlation"): e["ts"] for e in events if e.get("cat") == "cuda_runtime"}
    frames = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
                    if e.get("cat") == "python_function")
    starts = [f[0] for f in frames]
    if not kernels:
        return "no device kernels in the trace (a CPU run)"
    busy, gaps, end = 0.0, [], kernels[0][0]
    previous = kernels[0]
    for k in kernels:
        if k[0] > end:
            gaps.append((k[0] - end, previous, k))
        busy += max(0.0, k[1] - max(k[0], end))
        if k[1] > end:
            end, previous = k[1], k
    wall = end - kernels[0][0]
    idle = [g for g in gaps if g[0] >= MIN_GAP_US]
    lines = [f"{STEPS} steps: device wall {wall / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms, idle {(wall - busy) / 1e3:.1f} ms "
             f"({100 * (wall - busy) / wall:.1f}%), {len(idle)} gaps of {MIN_GAP_US:.0f} us or more "
             f"({sum(g[0] for g in idle) / 1e3:.1f} ms)",
             f"{'gap us':>8} {'launch lag us':>13}  kernel before -> kernel after | launched from"]
    for dur, before, after in sorted(idle, reverse=True)[:rows]:
        launched = launches.get(after[3])
        lag = f"{after[0] - launched:13.0f}" if launched is not None else f"{'?':>13}"
        where = _python_stack(frames, starts, launched) if launched is not None else "?"
        lines.append(f"{dur:8.0f} {lag}  {before[2][:40]} -> {after[2][:40]} | {where}")
    return "\n".join(lines)


def profile_gaps(trainer, step: int, trace: str | None) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        for s in range(STEPS):
            trainer.train_step(step + s)
        torch.cuda.synchronize()
    return analyse(trace_events(prof, trace))


def trace_events(prof, keep: str | None = None) -> list[dict]:
    """The profiler's Chrome-trace events; ``keep``: also write the trace there, gzipped."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        if keep:
            with open(path, "rb") as src, gzip.open(keep, "wb") as dst:
                shutil.copyfileobj(src, dst)
    return events


def main(argv: list[str]) -> None:
    trace = None
    if "--trace" in argv:
        i = argv.index("--trace")
        trace = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    report = {}

    def table(trainer, step, rows=30):
        report["gaps"] = profile_gaps(trainer, step, trace)
        return ""

    bench.profile_table = table
    bench.main([*argv, "--profile", os.devnull])
    print(report["gaps"])


if __name__ == "__main__":
    main(sys.argv[1:])
