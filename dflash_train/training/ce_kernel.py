"""The GPU loss's chunk kernel in Triton: cross-entropy, argmax hits and d loss / d logits of
one chunk of head-dtype logits in two passes over each row.

Same contract as ``loss.fused_ce_reference`` (the ``ChunkKernel`` signature; that function
stays the reference and the fallback). What inductor makes of it reads each row three times
(max, then the exponentials' sum, then the gradient); here the first pass keeps a running max
and a rescaled running sum (online softmax), so a row is read twice and its gradient written
once: about 2/3 of the memory traffic, which is all this kernel costs (1024 x 152K bf16 logits
are 311 MB a chunk).

For a DFlash2 drafter the first pass also writes each row's maximum over every whole segment of
``SEGMENT`` columns (``segment_max``), the first step of ``loss.top_k_rows``: the selector's
top-K candidates then cost no pass of their own over the logits.
"""

from __future__ import annotations

import functools

import torch

BLOCK = 4096  # vocabulary entries per iteration: 16 per thread at 8 warps
SEGMENT = 128  # columns per segment maximum (``segment_max``); BLOCK holds a whole number of them


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def ce_rows(logits, labels, slot_w, grad, out_loss, out_ce, out_hit, seg_max, vocab, row_stride, segments,
                WITH_GRAD: tl.constexpr, SEG_MAX: tl.constexpr, BLOCK: tl.constexpr, SEGMENT: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits + row * row_stride
        label = tl.load(labels + row)
        w = tl.load(slot_w + row)
        offs = tl.arange(0, BLOCK)
        # pass 1: running max m, sum of exp(x - m), and the first index of the largest logit
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        best_idx = tl.zeros((), tl.int64)
        for start in range(0, vocab, BLOCK):
            cols = start + offs
            x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            top = tl.max(x, 0)
            top_idx = tl.min(tl.where(x == top, cols, vocab), 0).to(tl.int64)
            # strictly greater: a tie keeps the earlier block's index
            best_idx = tl.where(top > m, top_idx, best_idx)
            m_new = tl.maximum(m, top)
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
            m = m_new
            if SEG_MAX:  # the block's segments' maxima; only whole segments are kept
                seg = start // SEGMENT + tl.arange(0, BLOCK // SEGMENT)
                seg_top = tl.max(tl.reshape(x, (BLOCK // SEGMENT, SEGMENT)), 1)
                tl.store(seg_max + row * segments + seg, seg_top.to(seg_max.dtype.element_ty), mask=seg < segments)
        lse = m + tl.log(s)
        ce = lse - tl.load(base + label).to(tl.float32)
        tl.store(out_ce + row, ce)
        tl.store(out_loss + row, ce * w)
        tl.store(out_hit + row, best_idx == label)
        if WITH_GRAD:  # pass 2: (softmax - onehot) * w in the logits' dtype
            gbase = grad + row * vocab
            for start in range(0, vocab, BLOCK):
                cols = start + offs
                inside = cols < vocab
                x = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
                p = tl.exp(x - lse)
                g = tl.where(cols == label, p - 1.0, p) * w
                tl.store(gbase + cols, g.to(grad.dtype.element_ty), mask=inside)

    return ce_rows


def available(device: torch.device) -> bool:
    """Whether the Triton kernel can run here (a CUDA device with Triton installed)."""
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def fused_ce(logits: torch.Tensor, teacher: torch.Tensor | None, labels: torch.Tensor, slot_w: torch.Tensor,
             with_grad: bool, segment_max: torch.Tensor | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``loss.fused_ce_reference`` for CUDA logits (c, V): (w * CE (c,), CE (c,), hits (c,),
    w * dCE/dlogits or None).

    ``teacher`` is unused (the signature every chunk kernel has). ``segment_max`` (c, V // SEGMENT)
    in the logits' dtype, when given, receives each row's maximum over columns
    [j * SEGMENT, (j + 1) * SEGMENT): ``logits.unfold(1, SEGMENT, SEGMENT).amax(-1)``.
    """
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    ce = torch.empty_like(loss)
    hit = torch.empty(rows, dtype=torch.bool, device=logits.device)
    grad = torch.empty(rows, vocab, dtype=logits.dtype, device=logits.device) if with_grad else None
    assert segment_max is None or (segment_max.shape == (rows, vocab // SEGMENT) and segment_max.is_contiguous()
                                   and segment_max.dtype == logits.dtype), "segment_max: (c, V // SEGMENT), logits' dtype"
    _kernel()[(rows,)](logits, labels, slot_w.float(), grad if with_grad else logits, loss, ce, hit,
                       logits if segment_max is None else segment_max, vocab, logits.stride(0), vocab // SEGMENT,
                       WITH_GRAD=with_grad, SEG_MAX=segment_max is not None, BLOCK=BLOCK, SEGMENT=SEGMENT,
                       num_warps=8)
    return loss, ce, hit, grad
