"""Issue 38, round two: the parts of DSpark's and DFlash2's training steps that changed after the
`6aff139` measurement (benchmarks/quality-arms/README.md, "four H100s of one host"), each old
against new, at the one-H100 recipe's shapes (Qwen2.5-Coder-0.5B: hidden 896, vocabulary 151,936;
selector and Markov rank 256, top-16 candidates).

    python -m benchmarks.kinds_step_parts                                 # CPU: 4,096 rows, chunks of 512
    python -m benchmarks.kinds_step_parts --rows 61440 --chunk 1024       # a GPU: the recipe's step

Rows, each over the step's supervised rows:
  * dflash2 selector scores, forward + backward: ``pair_scores_indexed`` (the codebooks read as
    ``codebook[ids]``, whose backward is a sorted index_put that adds each repeated id's rows one
    after another: 42 ms of the H100 step) against ``CandidateSelector.forward`` (F.embedding).
    The candidates repeat as a step's top-16 do: drawn from a Zipf law over the vocabulary.
  * dflash2 candidates: ``top_k_rows`` finding its segment maxima (an amax pass over each chunk's
    logits: 23 ms of the H100 step) against ``top_k_rows`` given them. On a GPU the maxima come
    from the CE kernel's first pass: that row is the CE kernel without and with writing them,
    plus ``top_k_rows``; on a CPU there is no such kernel (the plain walk) and the row shows
    what the amax pass costs there.
  * dflash2 top-16 from the segment maxima (a GPU only): ``top_k_by_segments`` (a topk of the
    maxima, a gather of the 16 best segments' columns, a second topk) and the copies into the
    candidates' table, as ``_keep_top`` ran them, against the Triton kernel (training/topk_kernel.py)
    writing into the table. The maxima are given (the CE kernel writes them); the CE kernel
    itself is not in this row.
  * dspark chunk function, with its gradient: ``dspark_chunk_terms`` compiled (73.7 ms of the H100
    step) against the Triton kernel (training/dspark_kernel.py). A GPU only: on a CPU both walks
    run the same eager function.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.cuda_timing import timer
from dflash_train.model.dflash2 import CandidateSelector
from dflash_train.training import ce_kernel, dspark_kernel, topk_kernel
from dflash_train.training.dspark_loss import dspark_chunk_terms
from dflash_train.training.loss import TOP_K_SEGMENT, compiled_kernel, top_k_by_segments, top_k_rows

HIDDEN, VOCAB, RANK, TOP_K = 896, 151936, 256, 16


def pair_scores_indexed(selector: CandidateSelector, h: torch.Tensor, pred: torch.Tensor,
                        cand: torch.Tensor) -> torch.Tensor:
    """``CandidateSelector.forward`` as it was at 6aff139, the codebooks read by advanced
    indexing: the reference the F.embedding reads are held to (tests/unit/test_kinds_step_parts.py)."""
    query = selector.predecessor_codebook[pred] * selector.hidden_projection(h.to(selector.hidden_projection.weight.dtype))
    return torch.einsum("mr,mkr->mk", query.float(), selector.successor_codebook[cand].float())


def zipf_tokens(shape: tuple[int, ...], vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Token ids drawn with probability proportional to 1 / (rank + 1): common tokens repeat
    across rows as a step's top-K candidates do."""
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    n = 1
    for s in shape:
        n *= s
    return torch.multinomial(weights, n, replacement=True, generator=generator).view(shape)


def selector_row(args, device, median) -> tuple[float, float]:
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(1)
    selector = CandidateSelector(HIDDEN, VOCAB, RANK)
    with torch.no_grad():
        for p in selector.parameters():
            p.normal_(0, 0.02)
    selector.to(device)
    h = torch.randn(args.rows, HIDDEN, generator=g).to(device)
    pred = zipf_tokens((args.rows,), VOCAB, g).to(device)
    cand = zipf_tokens((args.rows, TOP_K), VOCAB, g).to(device)
    grad = torch.randn(args.rows, TOP_K, generator=g).to(device)
    params = list(selector.parameters())

    def run(fn):
        return lambda: torch.autograd.grad(fn(selector, h, pred, cand), params, grad)

    return median(run(pair_scores_indexed), run(CandidateSelector.forward))


def candidates_row(args, device, median) -> tuple[float, float]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device).manual_seed(2)
    logits = torch.randn(args.chunk, VOCAB, generator=g, device=device).to(dtype)  # one chunk, every chunk
    chunks = -(-args.rows // args.chunk)
    if device.type != "cuda":
        seg = topk_kernel.segment_maxima(logits)
        return median(lambda: [top_k_rows(logits, TOP_K) for _ in range(chunks)],
                      lambda: [top_k_rows(logits, TOP_K, seg) for _ in range(chunks)])
    labels = torch.randint(0, VOCAB, (args.chunk,), generator=g, device=device)
    w = torch.rand(args.chunk, generator=g, device=device)
    seg = torch.empty(args.chunk, VOCAB // TOP_K_SEGMENT, dtype=dtype, device=device)

    def old():
        for _ in range(chunks):
            ce_kernel.fused_ce(logits, None, labels, w, True)
            top_k_rows(logits, TOP_K)

    def new():
        for _ in range(chunks):
            ce_kernel.fused_ce(logits, None, labels, w, True, segment_max=seg)
            top_k_rows(logits, TOP_K, seg)

    return median(old, new)


def topk_row(args, device, median) -> tuple[float, float]:
    g = torch.Generator(device).manual_seed(4)
    logits = torch.randn(args.chunk, VOCAB, generator=g, device=device).bfloat16()  # one chunk, every chunk
    seg = topk_kernel.segment_maxima(logits)
    chunks = -(-args.rows // args.chunk)
    tokens = torch.empty(chunks * args.chunk, TOP_K, dtype=torch.long, device=device)
    values = torch.empty(chunks * args.chunk, TOP_K, device=device)

    def old():
        for i in range(chunks):
            sl = slice(i * args.chunk, (i + 1) * args.chunk)
            top, cols = top_k_by_segments(logits, TOP_K, seg)
            tokens[sl], values[sl] = cols, top.float()

    def new():
        for i in range(chunks):
            sl = slice(i * args.chunk, (i + 1) * args.chunk)
            topk_kernel.top_k(logits, TOP_K, seg, values=values[sl], columns=tokens[sl])

    return median(old, new)


def dspark_row(args, device, median) -> tuple[float, float]:
    dtype = torch.bfloat16
    g = torch.Generator(device).manual_seed(3)
    positions = args.rows // 10  # a position teaches about 10 slots in the recipe's packed rows
    z = (torch.randn(args.chunk, VOCAB, generator=g, device=device) * 2).to(dtype)
    table = (torch.randn(positions, VOCAB, generator=g, device=device) * 2).to(dtype)
    lse = torch.logsumexp(table.float(), dim=-1)
    rows = torch.randint(0, positions, (args.chunk,), generator=g, device=device)
    labels = torch.randint(0, VOCAB, (args.chunk,), generator=g, device=device)
    w = torch.rand(args.chunk, generator=g, device=device)
    chunks = -(-args.rows // args.chunk)
    compiled = compiled_kernel(dspark_chunk_terms, dynamic=None)

    def each(kernel):
        return lambda: [kernel(z, None, table, rows, lse, labels, w, 0.1, 0.9, True) for _ in range(chunks)]

    return median(each(compiled), each(dspark_kernel.dspark_terms))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=4096, help="supervised rows of the step")
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"{where}; {args.rows:,} supervised rows, chunks of {args.chunk}, hidden {HIDDEN}, vocabulary {VOCAB:,}, "
          f"rank {RANK}, top-{TOP_K}; median ms of {args.runs}")
    median = timer(device, args.runs)
    print("| kind | part (whole step) | old ms | new ms | new / old |")
    print("|---|---|---|---|---|")
    rows = [("dflash2", "selector scores, forward + backward", selector_row),
            ("dflash2", "top-16 candidates" + (" with the CE kernel" if device.type == "cuda" else ""),
             candidates_row)]
    if device.type == "cuda":
        rows.append(("dflash2", "top-16 from given segment maxima, torch against Triton", topk_row))
        rows.append(("dspark", "chunk function with its gradient", dspark_row))
    for kind, name, fn in rows:
        old, new = fn(args, device, median)
        print(f"| {kind} | {name} | {old:.1f} | {new:.1f} | {new / old:.2f} |", flush=True)


if __name__ == "__main__":
    main()
