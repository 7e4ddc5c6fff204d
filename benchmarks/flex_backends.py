"""The two backends of the drafter's compiled flex attention on the DFlash training mask:
inductor's Triton templates (``drafter.flex_backend=triton``) and FlashAttention-4's CuTe DSL
kernels (``drafter.flex_backend=flash``, ``pip install flash-attn-4``). For each backend it
prints forward and backward time, their TFLOP/s (attended pairs only) and the largest
difference from the Triton backend's output and gradients.

    python -m benchmarks.flex_backends [--ctx 8192 --anchors 1024 --heads 32 --kv-heads 8 --head-dim 128]
        [--json results.json]

The defaults are one layer of the Qwen3-8B drafter at 8192 tokens and 1024 anchors. The
second case packs 21 documents into the row, so each block sees only its own document.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import torch
from torch.nn.attention.flex_attention import flex_attention

from benchmarks.cuda_timing import median_ms
from dflash_train.model.masks import build_block_mask, document_starts

BLOCK = 16
BACKENDS = {"triton": None, "flash": {"BACKEND": "FLASH"}}


def case(args, packed: bool) -> dict:
    ctx, n = args.ctx, args.anchors
    anchors = torch.randperm(ctx - BLOCK, device="cuda")[:n].sort().values[None]
    doc_ids = None
    if packed:
        doc_ids = torch.zeros(1, ctx, dtype=torch.long, device="cuda")
        doc_ids[0, torch.randperm(ctx - 1, device="cuda")[:20] + 1] = 1
        doc_ids = doc_ids.cumsum(1)
    mask = build_block_mask(anchors, ctx, BLOCK, doc_ids)
    first = torch.zeros_like(anchors) if doc_ids is None else document_starts(doc_ids).gather(1, anchors)
    pairs = int((anchors - first).sum()) * BLOCK + n * BLOCK * BLOCK  # visible (query, key) pairs per head
    fwd_flop = 4 * pairs * args.head_dim * args.heads
    q = torch.randn(1, args.heads, n * BLOCK, args.head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, args.kv_heads, ctx + n * BLOCK, args.head_dim, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True) for _ in range(2))
    grad_out = torch.randn_like(q)
    rows, ref = {}, None
    for name, options in BACKENDS.items():
        row = {}
        try:
            attend = torch.compile(lambda q, k, v, options=options: flex_attention(
                q, k, v, block_mask=mask, scale=args.head_dim**-0.5, enable_gqa=True, kernel_options=options))
            t0 = time.time()
            out = attend(q, k, v)
            grads = torch.autograd.grad(out, (q, k, v), grad_out)
            torch.cuda.synchronize()
            row["compile_s"] = round(time.time() - t0, 1)
            if ref is None:
                ref = (out.detach(), grads)
            else:
                row["max_diff_out"] = (out.detach() - ref[0]).abs().max().item()
                row["max_diff_dq_dk_dv"] = [(g - r).abs().max().item() for g, r in zip(grads, ref[1])]
            with torch.no_grad():
                fwd = median_ms(lambda: attend(q, k, v))
            both = median_ms(lambda: torch.autograd.grad(attend(q, k, v), (q, k, v), grad_out))
            row.update(fwd_ms=round(fwd, 3), bwd_ms=round(both - fwd, 3),
                       fwd_tflops=round(fwd_flop / fwd / 1e9, 1),
                       bwd_tflops=round(2.5 * fwd_flop / (both - fwd) / 1e9, 1))
        except Exception as e:  # a backend that cannot run here is a row of the table, not the end of it
            row["error"] = traceback.format_exception_only(type(e), e)[-1].strip()[:300]
        rows[name] = row
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--anchors", type=int, default=1024)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("flex_backends.py: needs a CUDA GPU")
    torch.manual_seed(0)
    result = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), **vars(args)}
    print("| case | backend | forward ms | backward ms | forward TFLOP/s | backward TFLOP/s | max diff out | "
          "max diff dq, dk, dv |")
    print("|---|---|---|---|---|---|---|---|")
    for packed in (False, True):
        label = "21 packed documents" if packed else "one conversation"
        result[label] = case(args, packed)
        for name, r in result[label].items():
            if "error" in r:
                print(f"| {label} | {name} | {r['error']} |")
                continue
            diffs = r.get("max_diff_dq_dk_dv")
            print(f"| {label} | {name} | {r['fwd_ms']} | {r['bwd_ms']} | {r['fwd_tflops']} | {r['bwd_tflops']} | "
                  f"{r.get('max_diff_out', '-')} | {', '.join(f'{d:.4g}' for d in diffs) if diffs else '-'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
