"""Where a training step's device time goes: runs ``dflash_train.bench`` with the given
arguments, then profiles three more steps (on a GPU) and prints

  * by default: device time per step by kind of kernel (matmul, flex attention forward and
    backward, cuDNN attention, compiled Triton, eager ATen, copies), the kernels that take
    the most time (milliseconds and launches per step), and the matmul-like operators by
    input shape with their achieved TFLOP/s;
  * with ``--gaps``: the device's busy and idle time and its longest gaps between kernels,
    each with the Python frames that launched the kernel after it.

    python benchmarks/profile_step.py +experiment=qwen3_8b_8xh100 backend=single optim.grad_accum_steps=1 \\
        bench.random_target=true bench.steps=4 bench.warmup=3 data.max_length=8192 data.num_anchors=1024 \\
        [--gaps] [--out report.txt] [--trace trace.json.gz]

Compare the TFLOP/s column with the bench's measured bf16 matmul peak: a shape well below
it is where a fused projection or another kernel would pay. The kernel tables profile
without Python stacks, so the host's timing stays close to an unprofiled run's; ``--gaps``
records stacks. A gap whose next kernel was launched just before it ran means the host was
late (Python, a lock, a sync); a gap with an early launch means the device waited on
something else. (``bench.profile=FILE`` of the bench itself writes torch's per-operator
table of one step, on CPU too.)
"""

from __future__ import annotations

import bisect
import collections
import gzip
import json
import os
import re
import shutil
import sys
import tempfile

import torch

from dflash_train import bench
from dflash_train.training import throughput

STEPS = 3
MIN_GAP_US = 50.0
# First match wins: the flex backward kernel's name also contains "flex_attention".
KINDS = [("flex attention bwd", r"flex_attention_backward"), ("flex attention fwd", r"flex_attention"),
         ("cuDNN attention", r"cudnn|fmha|flash"), ("matmul", r"nvjet|gemm|cutlass|xmma|cublas|sm90"),
         ("copies", r"Memcpy|Memset"), ("compiled (Triton)", r"^triton_"), ("eager (ATen)", r".")]
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm")
DEVICE_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")


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


def kernel_tables(prof, events: list[dict], top: int = 40) -> str:
    kernels = [e for e in events if e.get("cat") in DEVICE_EVENTS]
    by_kind, by_name, launches = collections.Counter(), collections.Counter(), collections.Counter()
    for k in kernels:
        name, us = k["name"], k.get("dur", 0)
        by_kind[next(kind for kind, rx in KINDS if re.search(rx, name))] += us
        by_name[name[:110]] += us
        launches[name[:110]] += 1
    total = sum(by_kind.values())
    lines = [f"device busy per step (sum of kernel times): {total / STEPS / 1e3:.1f} ms"]
    lines += [f"  {kind:<20} {us / STEPS / 1e3:8.2f} ms  {100 * us / total:5.1f}%"
              for kind, us in by_kind.most_common()]
    lines.append(f"top kernels: {'ms/step':>8} {'calls/step':>10} {'us/call':>9}  name")
    lines += [f"  {'':<11}{us / STEPS / 1e3:8.2f} {launches[n] / STEPS:10.0f} {us / launches[n]:9.1f}  {n}"
              for n, us in by_name.most_common(top)]
    ops = sorted((k for k in prof.key_averages(group_by_input_shape=True) if k.key in MATMUL_OPS),
                 key=lambda k: -k.device_time_total)
    lines.append(f"matmuls by shape: {'ms/step':>8} {'calls/step':>10} {'TFLOP/s':>8}  op [inputs]")
    for k in ops[:top]:
        ms = k.device_time_total / STEPS / 1e3
        tflops = k.flops / STEPS / (ms * 1e-3) / 1e12 if k.flops and ms else 0.0
        lines.append(f"  {'':<16}{ms:8.2f} {k.count / STEPS:10.0f} {tflops:8.0f}  {k.key} {k.input_shapes}")
    return "\n".join(lines)


def _python_stack(frames: list[tuple[float, float, str]], starts: list[float], ts: float, depth: int = 4) -> str:
    """The innermost ``depth`` Python frames (of this repository or transformers) open at ``ts``."""
    i = bisect.bisect_right(starts, ts)
    open_ = [name for start, end, name in frames[max(0, i - 4000):i] if start <= ts <= end]
    useful = [n for n in open_ if "dflash_train" in n or "transformers" in n]
    return " < ".join(reversed(useful[-depth:])) or (open_[-1] if open_ else "?")


def gap_table(events: list[dict], rows: int = 15) -> str:
    kernels = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"], e.get("args", {}).get("correlation"))
                     for e in events if e.get("cat") in DEVICE_EVENTS)
    launches = {e.get("args", {}).get("correlation"): e["ts"] for e in events if e.get("cat") == "cuda_runtime"}
    frames = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
                    if e.get("cat") == "python_function")
    starts = [f[0] for f in frames]
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


def _take(argv: list[str], flag: str) -> tuple[str | None, list[str]]:
    """The value after ``flag`` and the arguments without the two."""
    if flag not in argv:
        return None, argv
    i = argv.index(flag)
    return argv[i + 1], argv[:i] + argv[i + 2:]


def main(argv: list[str]) -> None:
    out, argv = _take(argv, "--out")
    trace, argv = _take(argv, "--trace")
    gaps = "--gaps" in argv
    argv = [a for a in argv if a != "--gaps"]
    if not torch.cuda.is_available():
        raise SystemExit("profile_step.py profiles CUDA kernels: run it on a GPU")
    report = {}

    def profile(trainer, step: int) -> str:
        options = dict(with_stack=True) if gaps else dict(record_shapes=True, with_flops=True)
        prof = throughput.profile_steps(trainer, step, STEPS, **options)
        events = trace_events(prof, trace)
        report["text"] = gap_table(events) if gaps else kernel_tables(prof, events)
        return report["text"]

    with tempfile.TemporaryDirectory() as tmp:
        # Not os.devnull: bench.profile replaces no file but a profile of its own.
        bench.main([*argv, f"bench.profile={out or os.path.join(tmp, 'profile.txt')}"], profile=profile)
    print(report["text"])


if __name__ == "__main__":
    main(sys.argv[1:])
