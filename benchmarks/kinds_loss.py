"""DSpark's and DFlash2's losses now against their first formulations, phase by phase and whole
(forward and backward), beside DFlash's loss, on the one-H100 recipe's head: Qwen2.5-Coder-0.5B
(hidden 896, vocabulary 151,936), Markov and selector rank 256, top-16 candidates, blocks of 16.

    python -m benchmarks.kinds_loss                                  # CPU: 1 row of 48 positions, 30 blocks
    python -m benchmarks.kinds_loss --rows 2 --seq 3072 --blocks 1920 --chunk 1024   # a GPU: the recipe's step

The recipe packs 1,920 blocks into each row of 3,072 positions, so a position is the teacher of
about 10 DSpark slots; the CPU default keeps that ratio (30 blocks of 16 over 48 positions) with
few positions, so that a run takes minutes on 2 cores. Phases, each over the whole step's slots:
  * DSpark "teacher": first, the head on the target's final state of every slot (M rows); now,
    ``teacher_logits`` (the head on every position once, b * T rows, and its log-sum-exp).
  * DSpark "draft logits": first, U h and W2 e, two matmuls; now, one with [U ; W2].
  * DSpark "chunk function": the chunk terms and their gradient (the first reads three (c, V)
    inputs, base, Markov and teacher logits; now z and the table's rows).
  * DSpark "gradient matmuls": first, back through U and W2 apart (and W2's own); now through
    [U ; W2] at once (and W2's own).
  * DFlash2 "top-16": ``torch.topk`` of each chunk's logits (first) against ``top_k_rows`` (now).
  * whole losses, forward and backward: ``dspark_loss_first`` against ``dspark_loss``, and
    ``dflash_loss(top_k=16)`` plus ``selector_term`` with either top-k.
On a CPU the head dtype is float32 (a bf16 head on a CPU keeps the Markov matmul apart, as
before); on a GPU bf16, the chunk functions compiled as the trainer runs them.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn.functional as F

from benchmarks.cuda_timing import timer
from benchmarks.dspark_loss_first import dspark_chunk_terms_first, dspark_loss_first
from dflash_train import contract
from dflash_train.contract import IGNORE_INDEX
from dflash_train.model.dflash2 import DFlash2Config, DFlash2DraftModel
from dflash_train.model.dspark import DSparkConfig, DSparkDraftModel
from dflash_train.training import loss as loss_module
from dflash_train.training.dspark_loss import (
    DSparkLossWeights,
    dspark_chunk_terms,
    dspark_loss,
    teacher_index,
    teacher_logits,
)
from dflash_train.training.loss import (
    compiled_kernel,
    dflash_loss,
    selector_term,
    top_k_rows,
)

BLOCK, RANK, TOP_K = 16, 256, 16


def step_inputs(args, device, dtype):
    """Random rows of the recipe's shape: anchors sorted, every DSpark slot supervised (DFlash's
    slot 0 not), the target's final states and ids."""
    g = torch.Generator().manual_seed(0)
    b, t, n, vocab = args.rows, args.seq, args.blocks, args.vocab
    anchors = torch.stack([torch.randperm(t - BLOCK, generator=g)[:n].sort().values for _ in range(b)])  # (b, N)
    ids = torch.randint(0, vocab, (b, t), generator=g)
    labels = torch.randint(0, vocab, (b, n * BLOCK), generator=g)
    block_ids = torch.zeros(b, n * BLOCK, dtype=torch.long)
    block_ids[:, ::BLOCK] = ids.gather(1, anchors)
    hidden = torch.randn(b, n * BLOCK, args.hidden, generator=g).to(dtype)
    final = torch.randn(b, t, args.hidden, generator=g).to(dtype)
    head = torch.nn.Linear(args.hidden, vocab, bias=False).requires_grad_(False)
    torch.nn.init.normal_(head.weight, std=0.02)
    moved = [x.to(device) for x in (anchors, ids, labels, block_ids, hidden, final)]
    return (*moved, head.to(device, dtype))


def drafter_heads(args, device):
    common = dict(hidden_size=args.hidden, intermediate_size=64, num_attention_heads=1, num_key_value_heads=1,
                  head_dim=64, vocab_size=args.vocab, num_hidden_layers=1, num_target_layers=2, block_size=BLOCK,
                  dflash_config={"mask_token_id": 0, "target_layer_ids": [0]})
    dspark = DSparkDraftModel(DSparkConfig(markov_rank=RANK, **common)).to(device)
    common["dflash_config"] = dict(common["dflash_config"], conv_kernel_size=2, conv_group_size=16,
                                   selector_rank=RANK, selector_top_k=TOP_K)
    dflash2 = DFlash2DraftModel(DFlash2Config(**common)).to(device)
    with torch.no_grad():
        dflash2.candidate_selector.successor_codebook.normal_(0, 0.02)
    return dspark, dflash2


def dspark_phases(args, inputs, dspark, median) -> dict[str, tuple[float, float]]:
    """{phase: (first ms, now ms)} of the DSpark loss's parts over the whole step's slots."""
    anchors, _ids, labels, block_ids, hidden, final, head = inputs
    dev, dtype, c = hidden.device, head.weight.dtype, args.chunk
    fused = dev.type == "cuda"
    m = labels.numel()
    index = torch.arange(m, device=dev)
    rows = teacher_index(index, anchors, BLOCK, final.shape[1])  # (M,)
    h = hidden.flatten(0, 1)  # (M, H)
    s = final.flatten(0, 1).index_select(0, rows)  # (M, H)
    e = dspark.markov_head.embed(labels.flatten().clamp(min=0)).detach().to(dtype)  # (M, r): any tokens
    w2 = dspark.markov_head.markov_w2.weight.detach().to(dtype)
    joint = torch.cat([head.weight, w2], dim=1)
    chunks = [slice(i, i + c) for i in range(0, m, c)]
    table, lse = teacher_logits(final, head.weight, None, c, fused, fused)
    y, w = labels.flatten(), torch.rand(m, device=dev)
    first_kernel = compiled_kernel(dspark_chunk_terms_first) if fused else dspark_chunk_terms_first
    kernel = compiled_kernel(dspark_chunk_terms, dynamic=None) if fused else dspark_chunk_terms
    # One chunk's (c, V) inputs, reused by every chunk (the step's would not fit a GPU at once).
    base, teach = F.linear(h[:c], head.weight), F.linear(s[:c], head.weight)
    z, grad = F.linear(torch.cat([h[:c], e[:c]], 1), joint), base

    def each(fn):
        return lambda: [fn(sl) for sl in chunks]

    parts = {
        "teacher": (each(lambda sl: F.linear(s[sl], head.weight)),
                    lambda: teacher_logits(final, head.weight, None, c, fused, fused)),
        "draft logits": (each(lambda sl: (F.linear(h[sl], head.weight), F.linear(e[sl], w2))),
                         each(lambda sl: F.linear(torch.cat([h[sl], e[sl]], 1), joint))),
        "chunk function": (each(lambda sl: first_kernel(base, base, teach, y[sl], w[sl], 0.1, 0.9, True)),
                           each(lambda sl: kernel(z, None, table, rows[sl], lse, y[sl], w[sl], 0.1, 0.9, True))),
        "gradient matmuls": (each(lambda sl: (grad @ head.weight, grad @ w2, grad.t() @ e[sl])),
                             each(lambda sl: (grad @ joint, grad.t() @ e[sl]))),
    }
    out = {name: median(old, new) for name, (old, new) in parts.items()}
    weights = contract.slot_weights(BLOCK, 7.0, "dspark").to(dev)
    leaf = hidden.detach().requires_grad_()
    params = [leaf, *dspark.markov_head.parameters(), *dspark.confidence_head.parameters()]

    def whole(fn):
        def run():
            total = fn(dspark, leaf, labels, block_ids, anchors, final, head, weights, c, DSparkLossWeights(),
                       index.cpu()).weighted_sum
            torch.autograd.grad(total, params)
        return run

    out["whole loss, forward + backward"] = median(whole(dspark_loss_first), whole(dspark_loss))
    return out


@contextlib.contextmanager
def torch_topk_candidates():
    """The first formulation's candidates: ``torch.topk`` over each chunk's whole logits."""
    saved = loss_module.top_k_rows
    loss_module.top_k_rows = lambda logits, k, segment_max=None: logits.topk(k, dim=-1)
    try:
        yield
    finally:
        loss_module.top_k_rows = saved


def dflash2_phases(args, inputs, dflash2, median) -> dict[str, tuple[float, float]]:
    anchors, ids, labels, _block_ids, hidden, _final, head = inputs
    dev = hidden.device
    logits = F.linear(hidden.flatten(0, 1)[: args.chunk], head.weight)  # one chunk's logits
    chunks = -(-labels.numel() // args.chunk)
    out = {"top-16 of the logits": median(lambda: [logits.topk(TOP_K, dim=-1) for _ in range(chunks)],
                                          lambda: [top_k_rows(logits, TOP_K) for _ in range(chunks)])}
    dflash_labels = labels.clone()
    dflash_labels[:, ::BLOCK] = IGNORE_INDEX  # DFlash's slot 0, the anchor, is never supervised
    index = (dflash_labels.flatten() != IGNORE_INDEX).nonzero().squeeze(1)
    weights = contract.slot_weights(BLOCK, 7.0).to(dev)
    leaf = hidden.detach().requires_grad_()
    params = [leaf, *dflash2.candidate_selector.parameters()]

    def step(top_k: int):
        def run():
            o = dflash_loss(leaf, dflash_labels, head, weights, args.chunk, index=index.to(dev), top_k=top_k)
            total = o.weighted_sum
            if top_k:
                total = total + selector_term(dflash2, leaf, dflash_labels, ids, anchors, head, o.candidates,
                                              index.to(dev))[0]
            torch.autograd.grad(total, params if top_k else [leaf])
        return run

    def first():
        with torch_topk_candidates():
            step(TOP_K)()

    out["whole loss + selector, forward + backward"] = median(first, step(TOP_K))
    out["DFlash's loss alone (no top-k, no selector), forward + backward"] = (None, median(step(0), step(TOP_K))[0])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--seq", type=int, default=48, help="positions per row")
    p.add_argument("--blocks", type=int, default=30, help="blocks of 16 per row")
    p.add_argument("--chunk", type=int, default=240)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    if args.blocks > args.seq - BLOCK:
        raise SystemExit(f"--blocks={args.blocks} needs --seq of at least {args.blocks + BLOCK} (distinct anchors)")
    if args.rows * args.blocks * BLOCK % args.chunk:
        raise SystemExit(f"--chunk={args.chunk} must divide the {args.rows * args.blocks * BLOCK} DSpark slots")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    inputs = step_inputs(args, device, dtype)
    dspark, dflash2 = drafter_heads(args, device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"{where}; {args.rows} x {args.seq} positions, {args.blocks} blocks of {BLOCK} a row "
          f"({args.rows * args.blocks * BLOCK:,} DSpark slots), chunks of {args.chunk}, hidden {args.hidden}, "
          f"vocabulary {args.vocab:,}, {dtype} head; median ms of {args.runs}")
    median = timer(device, args.runs)
    print("| kind | phase (whole step) | first ms | now ms | now / first |")
    print("|---|---|---|---|---|")
    for kind, phases in (("dspark", dspark_phases(args, inputs, dspark, median)),
                         ("dflash2", dflash2_phases(args, inputs, dflash2, median))):
        for name, (old, new) in phases.items():
            if old is None:
                print(f"| {kind} | {name} | - | {new:.1f} | - |")
            else:
                print(f"| {kind} | {name} | {old:.1f} | {new:.1f} | {new / old:.2f} |", flush=True)


if __name__ == "__main__":
    main()
