"""Where a training step's device time goes: runs ``dflash_train.bench`` with the given
arguments, then profiles three more steps and prints

  * by default: device time per step by kind of kernel (matmul, flex attention forward and
    backward, cuDNN attention, compiled Triton, eager ATen, copies, collectives), the kernels
    that take the most time (milliseconds and launches per step), and the matmul-like
    operators by input shape with their achieved TFLOP/s;
  * with ``--gaps``: the device's busy and idle time and its longest gaps between kernels,
    each with the Python frames that launched the kernel after it.

    python benchmarks/profile_step.py +experiment=qwen3_8b_8xh100 backend=single optim.grad_accum_steps=1 \\
        bench.random_target=true bench.steps=4 bench.warmup=3 data.max_length=8192 data.num_anchors=1024 \\
        [--gaps] [--out report.txt] [--trace trace.json.gz]
    torchrun --standalone --nproc_per_node 2 benchmarks/profile_step.py backend=fsdp2 +experiment=... [--gaps]

Under torchrun (any backend but single) every rank profiles the same steps; rank 0 prints
its own tables, then what each rank's steps held (``rank_line``: step time, device busy and
idle, time inside collectives and the part of it no computation overlapped, host syncs) and
the collectives of a step by kind (calls, elements and megabytes, device time), each profiled
step's batch on every rank (tokens, rows, the milliseconds building it took) with the host's
milliseconds in the step (issue 40's straggler: whose host is late, and with what batch), and with
``--gaps`` where its host read tensors' values (each a sync on a GPU). NCCL (and
gloo) collectives are a kind of kernel of their own. ``--out`` and ``--trace`` are rank 0's;
rank N's report (its own tables, gaps and collectives) and trace are written beside them as
``rankN-NAME``: the slow rank of a pair is the one whose gaps say why.

Compare the TFLOP/s column with the bench's measured bf16 matmul peak: a shape well below
it is where a fused projection or another kernel would pay. The kernel tables profile
without Python stacks, so the host's timing stays close to an unprofiled run's; ``--gaps``
records stacks. A gap whose next kernel was launched just before it ran means the host was
late (Python, a lock, a sync); a gap with an early launch means the device waited on
something else. (``bench.profile=FILE`` of the bench itself writes torch's per-operator
table of one step, on CPU too.)

On a CPU (the tests run it on gloo) there are no kernels: the outermost operators of the
thread that ran the step stand for them, with gloo's collectives (run on gloo's threads;
gloo reduces a reduce-scatter as an all-reduce of the whole tensor), and a "host sync" is
any scalar read, which on a GPU would wait for the device only when the tensor lives there.
"""

from __future__ import annotations

import bisect
import collections
import gzip
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from dflash_train import bench
from dflash_train.distributed.launch import launch_env
from dflash_train.training import throughput

STEPS = 3
MIN_GAP_US = 50.0
COLLECTIVE = r"^nccl|^gloo:"
# First match wins: the flex backward kernel's name also contains "flex_attention".
KINDS = [("collectives", COLLECTIVE), ("flex attention bwd", r"flex_attention_backward"),
         ("flex attention fwd", r"flex_attention"), ("cuDNN attention", r"cudnn|fmha|flash"),
         ("matmul", r"nvjet|gemm|cutlass|xmma|cublas|sm90|^aten::(mm|addmm|bmm|linear|matmul)$"),
         ("copies", r"Memcpy|Memset"), ("compiled (Triton)", r"^triton_"), ("eager (ATen)", r".")]
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm")
DEVICE_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")
# A read of a tensor's value by the host: on a GPU it waits for everything queued before it.
HOST_SYNCS = ("aten::_local_scalar_dense",)
# Bytes of an element, by the dtype names of NCCL's (record_param_comms) and gloo's trace args.
ITEM_BYTES = {"float": 4, "float32": 4, "bfloat16": 2, "half": 2, "float16": 2, "double": 8, "float64": 8,
              "long": 8, "long int": 8, "int64": 8, "int": 4, "int32": 4}


class Kernel(NamedTuple):
    """A device event (microseconds), or on a CPU an operator standing for one."""

    start: float
    end: float
    name: str
    args: dict
    launched: float | None  # when the host launched it: a CPU operator's own start (GPU: see launches)


def _event(e: dict, launched: float | None = None) -> Kernel:
    return Kernel(e["ts"], e["ts"] + e.get("dur", 0), e["name"], e.get("args", {}), launched)


def _outermost(ops: list[dict]) -> list[dict]:
    """The operators no other one of ``ops`` (one thread's) encloses."""
    out, end = [], -math.inf
    for e in sorted(ops, key=lambda e: (e["ts"], -e.get("dur", 0))):
        if e["ts"] >= end:
            out.append(e)
            end = e["ts"] + e.get("dur", 0)
    return out


def device_kernels(events: list[dict]) -> list[Kernel]:
    """The device's kernels, copies and collectives, by start time. On a CPU: the outermost
    operators of the thread that ran the most (the step's), each its own launch, and gloo's
    collectives."""
    kernels = [_event(e) for e in events if e.get("cat") in DEVICE_EVENTS]
    if not kernels:
        threads = collections.Counter(e.get("tid") for e in events if e.get("cat") == "cpu_op")
        main = threads.most_common(1)[0][0] if threads else None
        ops = _outermost([e for e in events if e.get("cat") == "cpu_op" and e.get("tid") == main])
        gloo = [e for e in events if e.get("cat") in ("user_annotation", "cpu_op") and e["name"].startswith("gloo:")]
        kernels = [_event(e, e["ts"]) for e in ops + gloo]
    return sorted(kernels, key=lambda k: (k.start, k.end))


def launch_time(k: Kernel, launches: dict) -> float | None:
    """When the host launched ``k``; ``launches``: the CUDA runtime calls' times by correlation."""
    return k.launched if k.launched is not None else launches.get(k.args.get("correlation"))


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
    by_kind, by_name, launched = collections.Counter(), collections.Counter(), collections.Counter()
    for k in device_kernels(events):
        us = k.end - k.start
        by_kind[next(kind for kind, rx in KINDS if re.search(rx, k.name))] += us
        by_name[k.name[:110]] += us
        launched[k.name[:110]] += 1
    total = sum(by_kind.values())
    lines = [f"device busy per step (sum of kernel times): {total / STEPS / 1e3:.1f} ms"]
    lines += [f"  {kind:<20} {us / STEPS / 1e3:8.2f} ms  {100 * us / total:5.1f}%"
              for kind, us in by_kind.most_common()]
    lines.append(f"top kernels: {'ms/step':>8} {'calls/step':>10} {'us/call':>9}  name")
    lines += [f"  {'':<11}{us / STEPS / 1e3:8.2f} {launched[n] / STEPS:10.0f} {us / launched[n]:9.1f}  {n}"
              for n, us in by_name.most_common(top)]
    ops = sorted((k for k in prof.key_averages(group_by_input_shape=True) if k.key in MATMUL_OPS),
                 key=lambda k: -k.device_time_total)
    lines.append(f"matmuls by shape: {'ms/step':>8} {'calls/step':>10} {'TFLOP/s':>8}  op [inputs]")
    for k in ops[:top]:
        ms = k.device_time_total / STEPS / 1e3
        tflops = k.flops / STEPS / (ms * 1e-3) / 1e12 if k.flops and ms else 0.0
        lines.append(f"  {'':<16}{ms:8.2f} {k.count / STEPS:10.0f} {tflops:8.0f}  {k.key} {k.input_shapes}")
    return "\n".join(lines)


def _python_frames(events: list[dict]) -> tuple[list[tuple[float, float, str]], list[float]]:
    """The trace's Python frames (start, end, name) by start, and their starts (for bisect)."""
    frames = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
                    if e.get("cat") == "python_function")
    return frames, [f[0] for f in frames]


def _python_stack(frames: list[tuple[float, float, str]], starts: list[float], ts: float, depth: int = 4,
                  keep: tuple[str, ...] = ("dflash_train", "transformers")) -> str:
    """The innermost ``depth`` Python frames (of this repository or transformers, or whose
    file names contain one of ``keep``) open at ``ts``; a frame is named by the line its
    function starts on."""
    i = bisect.bisect_right(starts, ts)
    open_ = [name for start, end, name in frames[max(0, i - 4000):i] if start <= ts <= end]
    useful = [n for n in open_ if any(k in n for k in keep)]
    return " < ".join(reversed(useful[-depth:])) or (open_[-1] if open_ else "?")


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in spans)


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Time covered by both unions ``a`` and ``b``."""
    total, j = 0.0, 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            total += max(0.0, min(end, b[k][1]) - max(start, b[k][0]))
            k += 1
    return total


def gap_table(events: list[dict], rows: int = 15) -> str:
    kernels = device_kernels(events)
    launches = {e.get("args", {}).get("correlation"): e["ts"] for e in events if e.get("cat") == "cuda_runtime"}
    frames, starts = _python_frames(events)
    busy, gaps, end = 0.0, [], kernels[0].start
    previous = kernels[0]
    for k in kernels:
        if k.start > end:
            gaps.append((k.start - end, previous, k))
        busy += max(0.0, k.end - max(k.start, end))
        if k.end > end:
            end, previous = k.end, k
    wall = end - kernels[0].start
    idle = [g for g in gaps if g[0] >= MIN_GAP_US]
    lines = [f"{STEPS} steps: device wall {wall / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms, idle {(wall - busy) / 1e3:.1f} ms "
             f"({100 * (wall - busy) / wall:.1f}%), {len(idle)} gaps of {MIN_GAP_US:.0f} us or more "
             f"({sum(g[0] for g in idle) / 1e3:.1f} ms)",
             f"{'gap us':>8} {'launch lag us':>13}  kernel before -> kernel after | launched from"]
    for dur, before, after in sorted(idle, key=lambda g: -g[0])[:rows]:
        launched = launch_time(after, launches)
        lag = f"{after.start - launched:13.0f}" if launched is not None else f"{'?':>13}"
        where = _python_stack(frames, starts, launched) if launched is not None else "?"
        lines.append(f"{dur:8.0f} {lag}  {before.name[:40]} -> {after.name[:40]} | {where}")
    return "\n".join(lines)


def sync_table(events: list[dict], rank: int = 0, rows: int = 12) -> str:
    """Where the host read values of tensors (needs --gaps' Python stacks)."""
    frames, starts = _python_frames(events)
    keep = ("dflash_train", "transformers", "torch/optim", "torch/nn/utils", "torch/distributed")
    where = collections.Counter(_python_stack(frames, starts, e["ts"], 2, keep) for e in events
                                if e.get("cat") == "cpu_op" and e["name"] in HOST_SYNCS)
    lines = [f"host syncs per step (rank {rank}): {sum(where.values()) / STEPS:.0f}, by where the host read a value"]
    lines += [f"  {n / STEPS:6.1f}  {frame}" for frame, n in where.most_common(rows)]
    return "\n".join(lines)


def _collective(k: Kernel, world: int) -> tuple[str, int, float | None]:
    """(kind, elements of the whole tensor, bytes or None) of a collective kernel: NCCL's
    carry the call's record (``Collective name``, ``In/Out msg nelems``, ``dtype``), gloo's
    the shapes of their inputs (an all-gather's: this rank's part)."""
    args = k.args
    if "Collective name" in args:
        kind = args["Collective name"]
        elements = max(int(args.get("In msg nelems", 0)), int(args.get("Out msg nelems", 0)))
        dtype = str(args.get("dtype", ""))
    else:
        kind = k.name.split(":", 1)[1]
        dims = (args.get("Input Dims") or [[]])[0]
        elements = math.prod(dims) * (world if "gather" in kind else 1)
        dtype = str((args.get("Input type") or [""])[0])
    size = ITEM_BYTES.get(dtype.lower().removeprefix("c10::"))
    return kind, elements, None if size is None else elements * size


def collective_table(events: list[dict], world: int, rank: int = 0) -> str:
    calls, elements, sizes, us = (collections.Counter() for _ in range(4))
    unknown = set()
    for k in device_kernels(events):
        if re.search(COLLECTIVE, k.name):
            kind, n, size = _collective(k, world)
            calls[kind] += 1
            elements[kind] += n
            us[kind] += k.end - k.start
            if size is None:
                unknown.add(kind)
            else:
                sizes[kind] += size
    lines = [f"collectives per step (rank {rank}): {'calls':>6} {'M elements':>10} {'MB':>8} {'ms':>7}  kind"]
    for kind in sorted(calls, key=lambda kind: -us[kind]):
        mb = "?" if kind in unknown else f"{sizes[kind] / STEPS / 1e6:.2f}"
        lines.append(f"  {'':<28}{calls[kind] / STEPS:6.1f} {elements[kind] / STEPS / 1e6:10.3f} {mb:>8} "
                     f"{us[kind] / STEPS / 1e3:7.2f}  {kind}")
    return "\n".join(lines)


def rank_summary(events: list[dict], seconds: float) -> dict:
    """A rank's steps in numbers: wall time per step, the device's busy and idle time, the
    time inside collectives and the part of it no other kernel overlapped, host syncs."""
    kernels = device_kernels(events)
    every = _union([(k.start, k.end) for k in kernels])
    comms = _union([(k.start, k.end) for k in kernels if re.search(COLLECTIVE, k.name)])
    compute = _union([(k.start, k.end) for k in kernels if not re.search(COLLECTIVE, k.name)])
    wall = kernels[-1].end - kernels[0].start if kernels else 0.0
    busy = _length(every)
    return {"step_ms": 1e3 * seconds / STEPS, "busy_ms": busy / STEPS / 1e3, "idle_ms": (wall - busy) / STEPS / 1e3,
            "collective_ms": _length(comms) / STEPS / 1e3,
            "exposed_ms": (_length(comms) - _overlap(comms, compute)) / STEPS / 1e3,
            "host_syncs": sum(e["name"] in HOST_SYNCS for e in events if e.get("cat") == "cpu_op") / STEPS}


def rank_line(rank: int, s: dict) -> str:
    return (f"rank {rank}: step {s['step_ms']:.1f} ms, device busy {s['busy_ms']:.1f} ms, idle {s['idle_ms']:.1f} ms, "
            f"in collectives {s['collective_ms']:.1f} ms ({s['exposed_ms']:.1f} ms not overlapped), "
            f"host syncs {s['host_syncs']:.0f} per step")


class StepLog:
    """What the host did a step while ``trainer`` runs: each step's batches (tokens, rows, the
    milliseconds building them took, on whichever thread built them) and each ``train_step``
    call's host milliseconds (issuing its work, and waiting where it reads a value)."""

    def __init__(self, trainer):
        self.trainer, self.batches, self.steps = trainer, {}, {}

    def __enter__(self):
        t = self.trainer
        build, train = t.host_batches, t.train_step

        def host_batches(step):
            start = time.perf_counter()
            batches = build(step)
            self.batches[step] = (sum(b.stats.tokens for b in batches), sum(b.stats.rows for b in batches),
                                  1e3 * (time.perf_counter() - start))
            return batches

        def train_step(step, *args, **kwargs):
            start = time.perf_counter()
            out = train(step, *args, **kwargs)
            self.steps[step] = 1e3 * (time.perf_counter() - start)
            return out

        t.host_batches, t.train_step = host_batches, train_step
        return self

    def __exit__(self, *exc):
        del self.trainer.host_batches, self.trainer.train_step  # the class's methods again

    def rows(self) -> dict[int, tuple]:
        """step -> (tokens, rows, build ms, step host ms) for the steps that ran; the first three
        None where the step's batch was built (prefetched) before the log began."""
        return {s: (*self.batches.get(s, (None, None, None)), ms) for s, ms in sorted(self.steps.items())}


def step_table(by_rank: list[dict[int, tuple]]) -> str:
    """Each profiled step on every rank: its batch's tokens and rows, the milliseconds building
    it took and the host's milliseconds in the step. A straggler rank's host is slow where its
    batches are heavier (its own data) or its build thread took the interpreter from it."""
    lines = ["per step and rank (host): tokens, rows, batch built in ms, train_step host ms"]
    for step in sorted(set().union(*by_rank)):
        cells = []
        for r, rows in enumerate(by_rank):
            t = rows.get(step)
            if t is None:
                cells.append(f"rank {r}: -")
            elif t[0] is None:
                cells.append(f"rank {r}: batch built before the profile, {t[3]:7.1f} ms")
            else:
                cells.append(f"rank {r}: {t[0]:6d} tok {t[1]:3d} rows {t[2]:7.1f} ms {t[3]:7.1f} ms")
        lines.append(f"  step {step:4d}  " + "  |  ".join(cells))
    return "\n".join(lines)


def _take(argv: list[str], flag: str) -> tuple[str | None, list[str]]:
    """The value after ``flag`` and the arguments without the two."""
    if flag not in argv:
        return None, argv
    i = argv.index(flag)
    return argv[i + 1], argv[:i] + argv[i + 2:]


def _rank_path(path: str | None, rank: int) -> str | None:
    """Rank 0's ``path`` itself, another rank's ``rankN-NAME`` beside it."""
    if path is None or rank == 0:
        return path
    return str(Path(path).with_name(f"rank{rank}-{Path(path).name}"))


def main(argv: list[str]) -> None:
    out, argv = _take(argv, "--out")
    trace, argv = _take(argv, "--trace")
    gaps = "--gaps" in argv
    argv = [a for a in argv if a != "--gaps"]
    rank = launch_env().rank
    trace = _rank_path(trace, rank)
    report = {}

    def profile(trainer, step: int) -> str:
        # shapes under a process group: gloo's collectives carry their sizes in them
        options = dict(with_stack=True, record_shapes=dist.is_initialized()) if gaps else \
            dict(record_shapes=True, with_flops=True)
        start = time.perf_counter()
        with StepLog(trainer) as log:
            prof = throughput.profile_steps(trainer, step, STEPS, **options)
        seconds = time.perf_counter() - start
        events = trace_events(prof, trace)
        report["text"] = gap_table(events) if gaps else kernel_tables(prof, events)
        if dist.is_initialized():  # every rank's line, and the collectives of this rank's steps
            summaries = [None] * dist.get_world_size()
            dist.all_gather_object(summaries, rank_summary(events, seconds))
            report["text"] += "\n" + "\n".join(rank_line(r, s) for r, s in enumerate(summaries))
            report["text"] += "\n" + collective_table(events, dist.get_world_size(), rank)
            steps = [None] * dist.get_world_size()
            dist.all_gather_object(steps, log.rows())
            report["text"] += "\n" + step_table(steps)
            if gaps:
                report["text"] += "\n" + sync_table(events, rank)
        return report["text"]

    with tempfile.TemporaryDirectory() as tmp:
        # Not os.devnull: bench.profile replaces no file but a profile of its own. Rank 0's
        # report goes to --out, rank N's beside it (rankN-NAME).
        mine = _rank_path(out, rank) if out else os.path.join(tmp, "profile.txt")
        bench.main([*argv, f"bench.profile={mine}"], profile=profile)
    if rank == 0:
        print(report["text"])


if __name__ == "__main__":
    main(sys.argv[1:])
