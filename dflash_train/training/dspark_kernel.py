"""DSpark's chunk function in Triton: the CE and L1 terms of one chunk of head-dtype logits and
their gradient, in three passes over each row of z and two over its teacher row.

Same contract as ``dspark_loss.dspark_chunk_terms`` for z in one tensor (``markov`` None, as the
fused walk's joint matmul gives it); that function stays the reference and the fallback. What
inductor made of it was one reduction kernel that read each row of z four times and its teacher
row twice, 1.27 ms a chunk of 1024 x 151,936 on an H100 (73.7 of the one-H100 recipe's 279 ms
DSpark step). Here, per row:
  1. z: running max and rescaled sum of exponentials (online softmax), the argmax: lse, CE, hit;
  2. z and the teacher's row: q = exp(z - lse), p = exp(t - lse_t), L1 = sum |q - p| and
     spread = sum sign(q - p) q;
  3. (with the gradient) z and the teacher's row again: the gradient, written once in z's dtype.
"""

from __future__ import annotations

import functools

import torch

BLOCK = 4096  # vocabulary entries per iteration: 16 per thread at 8 warps (as ce_kernel)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def dspark_rows(logits, table, table_rows, table_lse, labels, slot_w, grad, out_loss, out_l1, out_hit,
                    vocab, row_stride, table_stride, ce_alpha, l1_alpha,
                    WITH_GRAD: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits + row * row_stride
        t_row = tl.load(table_rows + row).to(tl.int64)
        tbase = table + t_row * table_stride
        t_lse = tl.load(table_lse + t_row)
        label = tl.load(labels + row)
        w = tl.load(slot_w + row)
        offs = tl.arange(0, BLOCK)
        # pass 1: running max m, sum of exp(z - m), and the first index of the largest logit
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        best_idx = tl.zeros((), tl.int64)
        for start in range(0, vocab, BLOCK):
            cols = start + offs
            z = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            top = tl.max(z, 0)
            top_idx = tl.min(tl.where(z == top, cols, vocab), 0).to(tl.int64)
            best_idx = tl.where(top > m, top_idx, best_idx)  # strictly greater: a tie keeps the earlier index
            m_new = tl.maximum(m, top)
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
            m = m_new
        lse = m + tl.log(s)
        ce = lse - tl.load(base + label).to(tl.float32)
        # pass 2: L1 = sum |q - p| and spread = sum sign(q - p) q (sign 0 where q == p, as autograd's)
        l1 = tl.zeros((), tl.float32)
        spread = tl.zeros((), tl.float32)
        for start in range(0, vocab, BLOCK):
            cols = start + offs
            inside = cols < vocab
            q = tl.exp(tl.load(base + cols, mask=inside, other=float("-inf")).to(tl.float32) - lse)
            p = tl.exp(tl.load(tbase + cols, mask=inside, other=float("-inf")).to(tl.float32) - t_lse)
            d = q - p
            sign = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))
            l1 += tl.sum(tl.abs(d), 0)
            spread += tl.sum(sign * q, 0)
        tl.store(out_loss + row, (ce_alpha * ce + l1_alpha * l1) * w)
        tl.store(out_l1 + row, l1)
        tl.store(out_hit + row, best_idx == label)
        if WITH_GRAD:  # pass 3: (a (q - onehot) + b q (sign - spread)) * w in z's dtype
            gbase = grad + row * vocab
            for start in range(0, vocab, BLOCK):
                cols = start + offs
                inside = cols < vocab
                q = tl.exp(tl.load(base + cols, mask=inside, other=float("-inf")).to(tl.float32) - lse)
                p = tl.exp(tl.load(tbase + cols, mask=inside, other=float("-inf")).to(tl.float32) - t_lse)
                d = q - p
                sign = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))
                g = ce_alpha * tl.where(cols == label, q - 1.0, q) + l1_alpha * q * (sign - spread)
                tl.store(gbase + cols, (g * w).to(grad.dtype.element_ty), mask=inside)

    return dspark_rows


def dspark_terms(logits: torch.Tensor, markov: torch.Tensor | None, teacher: torch.Tensor,
                 teacher_rows: torch.Tensor, teacher_lse: torch.Tensor, labels: torch.Tensor,
                 slot_w: torch.Tensor, ce_alpha: float, l1_alpha: float, with_grad: bool):
    """``dspark_loss.dspark_chunk_terms`` for CUDA logits z (c, V) (``markov`` must be None):
    (w (a CE + b L1) (c,), L1 (c,), hits (c,), dz or None, None)."""
    assert markov is None, "the Triton chunk function takes z whole (the fused walk's joint matmul)"
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    assert teacher.stride(1) == 1, "the teacher table's rows must be contiguous"
    rows, vocab = logits.shape
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    l1 = torch.empty_like(loss)
    hit = torch.empty(rows, dtype=torch.bool, device=logits.device)
    grad = torch.empty(rows, vocab, dtype=logits.dtype, device=logits.device) if with_grad else None
    _kernel()[(rows,)](logits, teacher, teacher_rows, teacher_lse, labels, slot_w.float(),
                       grad if with_grad else logits, loss, l1, hit, vocab, logits.stride(0), teacher.stride(0),
                       float(ce_alpha), float(l1_alpha), WITH_GRAD=with_grad, BLOCK=BLOCK, num_warps=8)
    return loss, l1, hit, grad, None
