"""DSpark's loss against DFlash's and against its first formulation (benchmarks/dspark_loss_first.py),
forward and backward over one step's supervised slots, and on a GPU the parts of one chunk (the
head's and the Markov term's matmuls, the two chunk functions).

    python -m benchmarks.dspark_loss_speed [--slots 49152] [--hidden 896] [--vocab 151936] \\
        [--rank 256] [--chunk 1024] [--old PATH] [--device cpu]

Defaults: Qwen2.5-Coder-0.5B's head (bf16) and the one-H100 recipe's step (2 rows of 1920 blocks
of 16, about 49K supervised slots), on CUDA. ``--old PATH``: also time the ``dspark_loss`` of
another copy of dspark_loss.py (an earlier commit's), same arguments. ``--device cpu`` runs
each loss's CPU path (eager, unpadded chunks) and times with the host clock.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.cuda_timing import median_ms
from benchmarks.dspark_loss_first import dspark_chunk_terms_first, dspark_loss_first
from dflash_train import contract
from dflash_train.model.dspark import DSparkConfig, DSparkDraftModel
from dflash_train.training.dspark_loss import (
    DSparkLossWeights,
    dspark_chunk_terms,
    dspark_loss,
    teacher_logits,
)
from dflash_train.training.loss import compiled_kernel, dflash_loss

BLOCK = 16


def _case(args, dev):
    blocks = args.slots // BLOCK
    config = DSparkConfig(hidden_size=args.hidden, intermediate_size=64, num_attention_heads=1, num_key_value_heads=1,
                          head_dim=64, vocab_size=args.vocab, num_hidden_layers=1, num_target_layers=2,
                          block_size=BLOCK, markov_rank=args.rank,
                          dflash_config={"mask_token_id": 0, "target_layer_ids": [0]})
    drafter = DSparkDraftModel(config).to(dev)
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False).to(dev, args.head_dtype).requires_grad_(False)
    torch.nn.init.normal_(head.weight, std=0.02)
    hidden = torch.randn(1, blocks * BLOCK, args.hidden, device=dev, dtype=args.head_dtype, requires_grad=True)
    labels = torch.randint(0, args.vocab, (1, blocks * BLOCK), device=dev)
    block_ids = torch.randint(0, args.vocab, (1, blocks * BLOCK), device=dev)
    anchors = torch.arange(blocks, device=dev)[None]
    final = torch.randn(1, blocks + BLOCK, args.hidden, device=dev, dtype=args.head_dtype)
    index = torch.arange(blocks * BLOCK)  # on the host, as the trainer's
    return drafter, head, hidden, labels, block_ids, anchors, final, index


def _step(loss_fn, params):
    def run():
        out = loss_fn()
        torch.autograd.grad(out.weighted_sum, params)
    return run


def _host_median_ms(fn, runs: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - start))
    return sorted(times)[runs // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slots", type=int, default=49152)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--rank", type=int, default=256)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--old", default=None)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--head-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    args.head_dtype = getattr(torch, args.head_dtype)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("dspark_loss_speed.py: no CUDA GPU here; --device cpu times the CPU path")
    dev = torch.device(args.device)
    drafter, head, hidden, labels, block_ids, anchors, final, index = _case(args, dev)
    weights = contract.slot_weights(BLOCK, 7.0, "dspark").to(dev)
    dflash_weights = contract.slot_weights(BLOCK, 7.0).to(dev)
    params = [hidden, *drafter.markov_head.parameters(), *drafter.confidence_head.parameters()]
    dflash_labels = labels.clone()
    dflash_labels[:, ::BLOCK] = contract.IGNORE_INDEX  # DFlash never supervises the anchor slot
    dflash_index = (dflash_labels.flatten() != contract.IGNORE_INDEX).nonzero().squeeze(1).cpu()
    rows = {"dflash_loss": _step(lambda: dflash_loss(
        hidden, dflash_labels, head, dflash_weights, args.chunk, index=dflash_index), [hidden])}
    rows["dspark_loss"] = _step(lambda: dspark_loss(
        drafter, hidden, labels, block_ids, anchors, final, head, weights, args.chunk, DSparkLossWeights(), index),
        params)
    rows["dspark_loss_first (the first formulation)"] = _step(lambda: dspark_loss_first(
        drafter, hidden, labels, block_ids, anchors, final, head, weights, args.chunk, DSparkLossWeights(), index),
        params)
    if args.old:
        spec = importlib.util.spec_from_file_location("old_dspark_loss", args.old)
        old = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = old
        spec.loader.exec_module(old)
        rows["dspark_loss of --old"] = _step(lambda: old.dspark_loss(
            drafter, hidden, labels, block_ids, anchors, final, head, weights, args.chunk, old.DSparkLossWeights(),
            index=index), params)
    where = torch.cuda.get_device_name() if dev.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"{args.slots} slots, chunks of {args.chunk}, hidden {args.hidden}, vocabulary {args.vocab}, "
          f"Markov rank {args.rank}, {args.head_dtype} head, {where}")
    timer = median_ms if dev.type == "cuda" else _host_median_ms
    for name, fn in rows.items():
        print(f"  {name:<44} {timer(fn, runs=args.runs, warmup=1):9.1f} ms forward + backward")
    if dev.type == "cuda":
        _chunk_parts(args, drafter, head, hidden, labels, final)


def _chunk_parts(args, drafter, head, hidden, labels, final):
    """Each part of one chunk alone on CUDA: the matmuls and the compiled chunk functions (the
    first formulation's, on base, Markov and teacher logits; today's, on z and the table's rows)."""
    c, dev = args.chunk, hidden.device
    h, s = hidden[0, :c].detach(), final[0, :c]
    e = torch.randn(c, args.rank, device=dev)
    w2 = drafter.markov_head.markov_w2.weight.detach()
    joint = torch.cat([head.weight, w2.to(head.weight.dtype)], dim=1)
    x = torch.cat([h, e.to(h.dtype)], dim=1)
    base, teacher = F.linear(h, head.weight), F.linear(s, head.weight)
    table, lse = teacher_logits(final, head.weight, None, c, True, True)
    rows = torch.arange(c, device=dev)
    y, w = labels[0, :c], torch.rand(c, device=dev)
    first, now = compiled_kernel(dspark_chunk_terms_first), compiled_kernel(dspark_chunk_terms, dynamic=None)
    parts = {
        "head matmul, bf16 (c, H) x (H, V)": lambda: F.linear(h, head.weight),
        "Markov matmul, bf16 (c, r) x (r, V)": lambda: F.linear(e.bfloat16(), w2.bfloat16()),
        "both at once, bf16 (c, H + r) x (H + r, V)": lambda: F.linear(x, joint),
        "chunk function, first (compiled)": lambda: first(base, base, teacher, y, w, 0.1, 0.9, True),
        "chunk function, now (compiled)": lambda: now(base, None, table, rows, lse, y, w, 0.1, 0.9, True),
    }
    print(f"one chunk of {c}:")
    for name, fn in parts.items():
        print(f"  {name:<48} {median_ms(fn):7.2f} ms")


if __name__ == "__main__":
    main()
