"""The engine's flex decode attention (data_gen/engine_attention.py) under other block sizes and
kernel options, on the shapes of issue 39's job: 512 slots, Qwen2.5-0.5B's 2 KV heads of 64
with 7 query heads each, a 3,584-column cache, rows at positions spread around a mean of about
550 (the profile's median chunk), 24 layers a step. For each candidate: milliseconds a step (a
CUDA graph of the 24 layers, the BlockMask built once a step as the engine does), the bytes the
kernel reads and the live rows hold per second, and the largest difference from SDPA over the
visible columns. The engine's choice is the row `default` (DECODE_BLOCK, DECODE_KERNEL_OPTIONS).

    python -m benchmarks.flex_decode_sweep [--slots 512 --columns 3584 --mean-pos 550 --layers 24]
    python -m benchmarks.flex_decode_sweep --device cpu --slots 4 --columns 256 --mean-pos 60 --layers 2 \\
        --candidates default    # the CPU smoke: one row, host time
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from benchmarks.cuda_timing import step_seconds
from data_gen.engine_attention import DECODE_BLOCK, DECODE_KERNEL_OPTIONS, block_mask, kv_blocks, visible

# name: (mask block, kernel options); flex's decoding kernel takes SPLIT_KV (programs a row and
# head: 1 when slots x heads fill the GPU), BLOCK_N (columns a tile), num_warps and num_stages.
CANDIDATES = {
    "default": (DECODE_BLOCK, DECODE_KERNEL_OPTIONS),
    "inductor": (DECODE_BLOCK, {}),
    "block64": (64, {}),
    "block256": (256, {}),
    "split2": (DECODE_BLOCK, {"SPLIT_KV": 2}),
    "split4": (DECODE_BLOCK, {"SPLIT_KV": 4}),
    "n32": (DECODE_BLOCK, {"BLOCK_N": 32}),
    "n128": (DECODE_BLOCK, {"BLOCK_N": 128}),
    "warps2": (DECODE_BLOCK, {"num_warps": 2}),
    "warps8": (DECODE_BLOCK, {"num_warps": 8}),
    "stages1": (DECODE_BLOCK, {"num_stages": 1}),
    "stages3": (DECODE_BLOCK, {"num_stages": 3}),
    "split2-stages3": (DECODE_BLOCK, {"SPLIT_KV": 2, "num_stages": 3}),
    "split4-stages3": (DECODE_BLOCK, {"SPLIT_KV": 4, "num_stages": 3}),
    "split2-stages4": (DECODE_BLOCK, {"SPLIT_KV": 2, "num_stages": 4}),
    "n128-stages3": (DECODE_BLOCK, {"BLOCK_N": 128, "num_stages": 3}),
    "block64-split2-stages3": (64, {"SPLIT_KV": 2, "num_stages": 3}),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--slots", type=int, default=512)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--groups", type=int, default=7, help="query heads per KV head")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--columns", type=int, default=3584)
    p.add_argument("--mean-pos", type=int, default=550)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--candidates", default=",".join(CANDIDATES), help=f"some of {list(CANDIDATES)}")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    bad = [c for c in args.candidates.split(",") if c not in CANDIDATES]
    if bad:
        p.error(f"--candidates: {bad} not in {list(CANDIDATES)}")
    if not 0 < args.mean_pos < args.columns // 2:
        p.error(f"--mean-pos {args.mean_pos}: expected 1 to {args.columns // 2 - 1} (positions spread to twice it)")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch._dynamo.config.recompile_limit = 64  # one compile a candidate, in one process
    g = torch.Generator().manual_seed(0)
    b, hkv, groups, d, length = args.slots, args.kv_heads, args.groups, args.head_dim, args.columns
    pos = torch.randint(0, 2 * args.mean_pos, (b,), generator=g).to(device)
    live = torch.ones(b, dtype=torch.bool, device=device)
    q = torch.randn(b, hkv, groups, d, generator=g).to(device, dtype)
    ks = [torch.randn(b, hkv, length, d, generator=g).to(device, dtype) for _ in range(min(args.layers, 2))]
    vs = [torch.randn(b, hkv, length, d, generator=g).to(device, dtype) for _ in range(min(args.layers, 2))]
    seen = visible(pos, length, None)[:, None, None, :]
    reference = F.scaled_dot_product_attention(q, ks[0], vs[0], attn_mask=seen, scale=d**-0.5).float()
    compiled = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    per_column = hkv * d * 2 * q.element_size()  # K and V of one column, one layer
    held = int((pos + 1).sum()) * per_column * args.layers
    print(f"{b} slots x {hkv} KV heads x {groups} queries, head dim {d}, {length} columns, positions 0-"
          f"{2 * args.mean_pos - 1} (mean {pos.float().mean():.0f}), {args.layers} layers, {dtype} on {device}")
    print(f"{'candidate':<16}{'block':>6}  {'options':<34}{'ms a step':>10}{'read GB/s':>11}{'held GB/s':>11}{'max diff':>10}")
    rows = []
    for name in args.candidates.split(","):
        block, options = CANDIDATES[name]
        count, _ = kv_blocks(pos, live, length, None, block)
        read = int(count.sum()) * block * per_column * args.layers
        try:
            def step():
                mask = block_mask(pos, live, length, groups, None, block)
                return [compiled(q, ks[i % len(ks)], vs[i % len(vs)], block_mask=mask, scale=d**-0.5,
                                 kernel_options=(options or None) if q.is_cuda else None) for i in range(args.layers)]

            with torch.inference_mode():
                diff = (step()[0].float() - reference).abs().max().item()
                seconds = step_seconds(step, device, args.runs)
        except Exception as e:  # an option this kernel or machine refuses: its row says why
            print(f"{name:<16}{block:>6}  {json.dumps(options):<34}  failed: {type(e).__name__}: {str(e)[:120]}")
            rows.append({"candidate": name, "block": block, "options": options, "error": f"{type(e).__name__}: {e}"})
            continue
        print(f"{name:<16}{block:>6}  {json.dumps(options):<34}{1e3 * seconds:>10.3f}{read / seconds / 1e9:>11.1f}"
              f"{held / seconds / 1e9:>11.1f}{diff:>10.2e}", flush=True)
        rows.append({"candidate": name, "block": block, "options": options, "ms": 1e3 * seconds,
                     "read_gbs": read / seconds / 1e9, "held_gbs": held / seconds / 1e9, "max_diff": diff})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
