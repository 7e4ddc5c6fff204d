"""The GPU loss's chunk kernel: the Triton kernel (``dflash_train/training/ce_kernel.py``, the
CUDA default) against ``loss.fused_ce_reference`` through torch.compile (its reference and the
fallback), on one chunk of head-dtype logits, with the gradient and without.

    python -m benchmarks.ce_kernel [--rows 1024] [--vocab 151936] [--dtype bfloat16]

Prints the median time of each and the memory rate it implies, counting each kernel's
minimum traffic (logits read twice and the gradient written once, or logits read once).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.cuda_timing import median_ms
from dflash_train.training import ce_kernel
from dflash_train.training.loss import compiled_kernel, fused_ce_reference


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ce_kernel.py: needs a CUDA GPU")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    logits = (torch.randn(args.rows, args.vocab, device="cuda") * 4).to(dtype)
    labels = torch.randint(0, args.vocab, (args.rows,), device="cuda")
    weights = torch.rand(args.rows, device="cuda")
    size = logits.numel() * logits.element_size()
    kernels = {"triton (ce_kernel.fused_ce)": ce_kernel.fused_ce,
               "torch.compile(fused_ce_reference)": compiled_kernel(fused_ce_reference)}
    print(f"one chunk of {args.rows} x {args.vocab} {args.dtype} logits ({size / 1e6:.0f} MB)")
    print("| kernel | with gradient ms | GB/s at 3 passes | loss only ms | GB/s at 1 pass |")
    print("|---|---|---|---|---|")
    for name, kernel in kernels.items():
        both = median_ms(lambda: kernel(logits, None, labels, weights, True), runs=20, warmup=5)
        loss = median_ms(lambda: kernel(logits, None, labels, weights, False), runs=20, warmup=5)
        print(f"| {name} | {both:.3f} | {3 * size / both / 1e6:.0f} | {loss:.3f} | {size / loss / 1e6:.0f} |")


if __name__ == "__main__":
    main()
