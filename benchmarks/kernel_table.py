"""Where a training step's device time goes, by kernel: runs ``dflash_train.bench`` with the
given arguments, then profiles three more steps and prints

  * device time per step by kind of kernel (matmul, flex attention forward and backward,
    cuDNN attention, compiled Triton, eager ATen, copies),
  * the kernels that take the most time (milliseconds per step, launches per step),
  * the matmul-like operators by input shape with their achieved TFLOP/s.

    python benchmarks/kernel_table.py +experiment=qwen3_8b_8xh100 backend=single optim.grad_accum_steps=1 \
        --random-target --steps 4 --warmup 3 data.max_length=8192 data.num_anchors=1024 [--out table.txt]

Compare the TFLOP/s column with the bench's measured bf16 matmul peak: a shape well below
it is where a fused projection or another kernel would pay. Steps are profiled without
Python stacks, so the host's timing is close to an unprofiled run's.
"""

from __future__ import annotations

import collections
import os
import re
import sys

import torch
from gpu_gaps import trace_events  # a sibling script: run this one as benchmarks/kernel_table.py

from dflash_train import bench

STEPS = 3
# First match wins: the flex backward kernel's name also contains "flex_attention".
KINDS = [("flex attention bwd", r"flex_attention_backward"), ("flex attention fwd", r"flex_attention"),
         ("cuDNN attention", r"cudnn|fmha|flash"), ("matmul", r"nvjet|gemm|cutlass|xmma|cublas|sm90"),
         ("copies", r"Memcpy|Memset"), ("compiled (Triton)", r"^triton_"), ("eager (ATen)", r".")]
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm")


def tables(prof, top: int = 40) -> str:
    kernels = [e for e in trace_events(prof) if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
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


def main(argv: list[str]) -> None:
    out = None
    if "--out" in argv:
        i = argv.index("--out")
        out, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    report = {}

    def profile(trainer, step, rows=30):
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True,
                     with_flops=True) as prof:
            for s in range(STEPS):
                trainer.train_step(step + s)
            torch.cuda.synchronize()
        report["tables"] = tables(prof)
        return report["tables"]

    if not torch.cuda.is_available():
        raise SystemExit("kernel_table.py profiles CUDA kernels: run it on a GPU")
    bench.profile_table = profile
    bench.main([*argv, "--profile", out or os.devnull])
    print(report["tables"])


if __name__ == "__main__":
    main(sys.argv[1:])
