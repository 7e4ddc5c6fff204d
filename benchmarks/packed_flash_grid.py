"""The grid of the engine's packed prefill attention (data_gen/engine_attention.py): flash
attention's variable-length kernel launches (max_seqlen_q / 128) x sequences x heads programs,
and a CUDA graph fixes both numbers for a shape: whatever the row holds, the engine passed the
row's length and one sequence a slot (513 at 512 slots) until bfeaab8, and most programs found
no rows and exited; it now passes bounds of a shape's own (Shapes.longest, Shapes.prompts). This
times one layer's call on issue 39's shapes (Qwen2.5-0.5B: 14 query heads, 2 KV heads of
64; prompts drawn around a mean of 220 tokens, as ShareGPT's every-turn prompts) with:

  slots      sequences slots + 1, max_seqlen_q the row's length (the engine before bfeaab8)
  cap        sequences slots + 1, max_seqlen_q min(length, max(columns, 2048)): no sequence of a
             row is longer (a prompt fits its cache row, the padding is under 2048 tokens)
  engine     as the engine passes them now: max_seqlen_q the cap, sequences Shapes.prompts + 1
             (one fresh prompt every 32 tokens of the row, a next turn every 16)
  exact      sequences the row's own (prompts + padding), max_seqlen_q its longest: the floor

and for the next turns' rows (queries a conversation's new tokens, keys its whole history). Each
variant's output over the real tokens must equal the first's bit for bit.

    python -m benchmarks.packed_flash_grid [--slots 512 --columns 3584 --lengths 2048,4096,8192,16384]
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from benchmarks.cuda_timing import median_ms
from data_gen.engine_prefill import FRESH_PROMPT_TOKENS, KEPT_TURN_TOKENS, PACKED_STEP, Shapes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slots", type=int, default=512)
    p.add_argument("--columns", type=int, default=3584)
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--lengths", default="2048,4096,8192,16384", help="packed row lengths (tokens)")
    p.add_argument("--mean", type=int, default=220, help="mean prompt (fresh) or new-turn (kept) tokens")
    p.add_argument("--history", type=int, default=700, help="mean tokens a next turn's row already holds")
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the rows here too")
    return p.parse_args(argv)


def draw(rng: random.Random, mean: int, total: int, most: int) -> list[int]:
    """Lengths (exponential around `mean`, 30 to `most`) that fill `total` tokens but a padding
    under 2048, as the engine's packed groups do."""
    out, used = [], 0
    while True:
        n = max(30, min(most, int(rng.expovariate(1 / mean))))
        if used + n > total:
            return out
        out.append(n)
        used += n
        if total - used < PACKED_STEP // 2 and rng.random() < 0.5:
            return out


def bounds(lengths: list[int], sequences: int, device) -> torch.Tensor:
    """Cumulative lengths of `lengths`, repeated up to sequences + 1 entries (empty sequences)."""
    cum = [0]
    for n in lengths:
        cum.append(cum[-1] + n)
    cum += [cum[-1]] * (sequences + 1 - len(cum))
    return torch.tensor(cum, dtype=torch.int32, device=device)


def flash(q, k, v, qb, kb, max_q, max_k):
    return torch.ops.aten._flash_attention_forward(q, k, v, qb, kb, max_q, max_k, 0.0, True, False)[0]


def row(kind: str, length: int, args, rng: random.Random) -> dict:
    dev, dt = torch.device("cuda"), torch.bfloat16
    q_lens = draw(rng, args.mean, length, args.columns)
    if kind == "fresh":
        k_lens = q_lens
    else:  # a next turn's keys: what the row holds, then the new tokens
        k_lens = [min(args.columns, n + max(1, int(rng.expovariate(1 / args.history)))) for n in q_lens]
    pad_q = length - sum(q_lens)
    k_len = length if kind == "fresh" else -(-sum(k_lens) // PACKED_STEP) * PACKED_STEP + pad_q
    q_all, k_all = q_lens + [pad_q], k_lens + [k_len - sum(k_lens)]
    q = torch.randn(length, args.heads, args.head_dim, device=dev, dtype=dt)
    k = torch.randn(k_len, args.kv_heads, args.head_dim, device=dev, dtype=dt)
    v = torch.randn_like(k)
    shapes = Shapes(True, args.columns, slots=args.slots)
    cap = shapes.longest(length)
    prompts = shapes.prompts(length, FRESH_PROMPT_TOKENS if kind == "fresh" else KEPT_TURN_TOKENS)
    assert len(q_lens) <= prompts, f"{len(q_lens)} prompts in {length} tokens: more than the engine's {prompts}"
    variants = {
        "slots": (args.slots + 1, length, k_len),
        "cap": (args.slots + 1, cap, k_len),
        "engine": (prompts + 1, cap, k_len),
        "exact": (len(q_all), max(q_all), max(k_all)),
    }
    out, ref = {"kind": kind, "length": length, "sequences": len(q_all), "longest": max(q_all)}, None
    real = sum(q_lens)
    for name, (seqs, max_q, max_k) in variants.items():
        qb, kb = bounds(q_all, seqs, dev), bounds(k_all, seqs, dev)
        o = flash(q, k, v, qb, kb, max_q, max_k)
        if ref is None:
            ref = o[:real]
        out[f"{name}_same"] = bool(torch.equal(o[:real], ref))
        out[f"{name}_us"] = 1000 * median_ms(lambda: flash(q, k, v, qb, kb, max_q, max_k), runs=args.runs)
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("packed_flash_grid: needs a CUDA GPU (flash attention's variable-length kernel)")
    rng = random.Random(args.seed)
    rows = [row(kind, int(n), args, rng) for kind in ("fresh", "kept") for n in args.lengths.split(",")]
    print(f"one layer's packed attention, {args.heads} heads / {args.kv_heads} KV of {args.head_dim}, "
          f"{args.slots} slots, {args.columns} columns, bf16 on {torch.cuda.get_device_name()}; microseconds a call")
    print(f"{'rows':<6}{'length':>7}{'seqs':>6}{'longest':>8}{'slots':>9}{'cap':>9}{'engine':>9}{'exact':>9}  same")
    for r in rows:
        same = "yes" if r["cap_same"] and r["engine_same"] and r["exact_same"] else "NO"
        print(f"{r['kind']:<6}{r['length']:>7}{r['sequences']:>6}{r['longest']:>8}{r['slots_us']:>9.1f}"
              f"{r['cap_us']:>9.1f}{r['engine_us']:>9.1f}{r['exact_us']:>9.1f}  {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
