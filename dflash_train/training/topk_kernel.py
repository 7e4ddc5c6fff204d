"""Each row's top-k logits and their columns in one Triton kernel: ``loss.top_k_rows`` on CUDA.

``loss.top_k_rows`` finds a row's top k among the k segments of ``SEGMENT`` columns of highest
maximum (and the columns past the last whole segment); the CUDA chunk kernel (``ce_kernel``)
writes those maxima in its first pass. In torch the rest is a ``topk`` of the maxima, an index
tensor of k * SEGMENT columns a row, a gather, a second ``topk`` and a gather of the columns:
six kernels and two (rows, k * SEGMENT) int64 tensors written and read back. Here one program
a row does it all: it reads the row's segment maxima, picks the k best segments, loads their
columns (k * SEGMENT values of the row, 4 KB in bf16 at k = 16) and writes the k best values
and columns, highest first.

Both picks compare one int64 key per entry: the value's float32 bits made monotone as a
signed integer in the high 32 bits, 2^31 - 1 - column in the low ones. Keys are distinct, so k
rounds of "take the maximum, knock it out" pick k entries in topk's order, equal values by
lowest column first (topk's own order among ties is unspecified). The values are the logits'
own (bf16 widens to float32 exactly). NaN is not ordered as topk orders it (as the largest):
a row with a NaN logit has a NaN loss anyway.
"""

from __future__ import annotations

import functools

import torch

from dflash_train.training.ce_kernel import SEGMENT, available  # noqa: F401  (where this kernel runs too)


def _build():
    """The kernel, jitted now: under TRITON_INTERPRET=1 (read when it is built) it runs on CPU
    tensors through Triton's interpreter, which the CPU tests use."""
    import triton
    import triton.language as tl

    # Helpers would be jit functions of their own, which Triton looks up among the module's globals,
    # not in this closure: the key arithmetic is written out where it is used.
    @triton.jit
    def top_k_rows(logits, seg_max, values, columns, vocab, row_stride, segments, seg_stride, out_stride,
                   K: tl.constexpr, KP: tl.constexpr, SEGS: tl.constexpr, SEGMENT: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits + row * row_stride
        # A key below every entry's: the float32 bits that map lowest (a negative NaN's), column 2^31 - 1.
        lowest = tl.full((), -0x7FFFFFFF - 1, tl.int32).to(tl.int64) << 32
        slots = tl.arange(0, KP)  # (KP,) places of the k best segments; those from K on are padding
        # the K segments of highest maximum, by K rounds of take-the-maximum-and-knock-it-out
        segs = tl.arange(0, SEGS)
        seg_in = segs < segments
        bits = tl.load(seg_max + row * seg_stride + segs, mask=seg_in, other=0.0).to(tl.float32).to(tl.int32,
                                                                                                     bitcast=True)
        bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # monotone in the value as signed int32
        seg_keys = tl.where(seg_in, (bits.to(tl.int64) << 32) + (0x7FFFFFFF - segs).to(tl.int64), lowest)  # (SEGS,)
        best_segs = tl.zeros((KP,), tl.int64)
        for i in tl.static_range(K):
            top = tl.max(seg_keys, 0)
            seg_keys = tl.where(seg_keys == top, lowest, seg_keys)
            # a key's low 32 bits hold 2^31 - 1 - index, in [0, 2^31)
            best_segs = tl.where(slots == i, 0x7FFFFFFF - top.to(tl.int32).to(tl.int64), best_segs)
        # their columns (KP, SEGMENT) and the tail's past the last whole segment (SEGMENT,): none of it
        # when V is a whole number of segments
        offs = tl.arange(0, SEGMENT)
        cols = best_segs[:, None] * SEGMENT + offs[None, :]  # (KP, SEGMENT)
        picked = (slots < K)[:, None] & (offs >= 0)[None, :]
        bits = tl.load(base + cols, mask=picked, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
        bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        keys = tl.where(picked, (bits.to(tl.int64) << 32) + (0x7FFFFFFF - cols), lowest)
        tail_cols = segments * SEGMENT + offs  # (SEGMENT,)
        tail_in = tail_cols < vocab
        bits = tl.load(base + tail_cols, mask=tail_in, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
        bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        tail_keys = tl.where(tail_in, (bits.to(tl.int64) << 32) + (0x7FFFFFFF - tail_cols).to(tl.int64), lowest)
        out = row * out_stride
        for i in tl.static_range(K):
            top = tl.maximum(tl.max(tl.max(keys, 1), 0), tl.max(tail_keys, 0))
            keys = tl.where(keys == top, lowest, keys)
            tail_keys = tl.where(tail_keys == top, lowest, tail_keys)
            ordered = (top >> 32).to(tl.int32)
            value = tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered).to(tl.float32, bitcast=True)
            tl.store(values + out + i, value.to(values.dtype.element_ty))
            tl.store(columns + out + i, 0x7FFFFFFF - top.to(tl.int32).to(tl.int64))

    return top_k_rows


_kernel = functools.cache(_build)


def segment_maxima(logits: torch.Tensor) -> torch.Tensor:
    """(n, V // SEGMENT) each row's maximum over every whole segment, as ``ce_kernel.fused_ce``
    writes them."""
    return logits.unfold(1, SEGMENT, SEGMENT).amax(dim=-1)


def top_k(logits: torch.Tensor, k: int, segment_max: torch.Tensor | None = None,
          values: torch.Tensor | None = None, columns: torch.Tensor | None = None,
          kernel=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits.topk(k, dim=-1)`` of logits (n, V) with V // SEGMENT > k: values (n, k) and columns
    (n, k) long, highest first (the module docstring says how equal values are ordered).

    ``segment_max`` (n, V // SEGMENT): the rows' segment maxima when computed already (the CE
    kernel's), else computed here. ``values`` (n, k) (the logits' dtype or float32) and
    ``columns`` (n, k) long receive the result in place when given, rows of stride >= k.
    ``kernel``: a kernel ``_build`` returned (tests: the interpreter's), else the cached one.
    """
    n, vocab = logits.shape
    segments = vocab // SEGMENT
    if segments < k:
        raise ValueError(f"top_k: {vocab} columns hold {segments} segments of {SEGMENT}, fewer than k={k}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if segment_max is None:
        segment_max = segment_maxima(logits)
    assert segment_max.shape == (n, segments) and segment_max.stride(1) == 1, "segment_max: (n, V // SEGMENT)"
    if values is None:
        values = torch.empty(n, k, dtype=logits.dtype, device=logits.device)
    if columns is None:
        columns = torch.empty(n, k, dtype=torch.long, device=logits.device)
    assert values.shape == columns.shape == (n, k) and values.stride() == columns.stride() and values.stride(1) == 1
    assert columns.dtype == torch.long, "columns: int64"
    if n == 0:
        return values, columns
    (kernel or _kernel())[(n,)](
        logits, segment_max, values, columns, vocab, logits.stride(0), segments, segment_max.stride(0),
        values.stride(0), K=k, KP=max(1, 1 << (k - 1).bit_length()), SEGS=1 << (segments - 1).bit_length(),
        SEGMENT=SEGMENT, num_warps=4)
    return values, columns
