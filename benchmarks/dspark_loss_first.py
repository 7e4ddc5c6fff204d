"""DSpark's loss as training/dspark_loss.py first computed it (commit b931988), kept as the
reference the current one is held to (tests/unit/test_dspark_loss_equivalence.py) and timed
against (benchmarks/kinds_loss.py): per chunk a head matmul U h, a Markov matmul W2 e and a
teacher matmul U s for every supervised slot, and the gradient back through U and W2 apart.
The current walk computes z = U h + W2 e as one matmul and the teacher once per position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash_train.training.dspark_loss import (
    DSparkLossWeights,
    loss_output,
    supervised_rows,
    teacher_index,
)
from dflash_train.training.loss import LossOutput, compiled_kernel


def dspark_chunk_terms_first(base: torch.Tensor, markov: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor,
                       slot_w: torch.Tensor, ce_alpha: float, l1_alpha: float, with_grad: bool):
    """One chunk of the head terms, from the base logits U h (c, V) in the head's dtype, the
    Markov bias W2 W1[prev] (c, V), the teacher's logits U s (c, V), labels (c,) and slot
    weights (c,) float32.

    Returns w (a CE + b L1) (c,), L1 (c,), argmax hits (c,) and, with ``with_grad``, the
    gradient of the first with respect to z in ``base``'s dtype (for the head's matmul) and in
    ``markov``'s (for the Markov term's), else None twice. Plain torch, so that inductor fuses
    it: float32 lives in registers and each (c, V) input is read a few times, never written.
    """
    z = base.float() + markov.float()  # (c, V) the Markov-corrected logits
    top, argmax = z.max(dim=-1)  # (c,)
    lse = top + (z - top[:, None]).exp().sum(dim=-1).log()  # (c,)
    q = (z - lse[:, None]).exp()  # (c, V) the draft distribution
    ce = lse - z.gather(1, labels[:, None]).squeeze(1)  # (c,)
    t = teacher.float()
    t_exp = (t - t.amax(dim=-1, keepdim=True)).exp()
    p = t_exp / t_exp.sum(dim=-1, keepdim=True)  # (c, V) the target's distribution: no gradient
    l1 = (q - p).abs().sum(dim=-1)  # (c,)
    loss = (ce_alpha * ce + l1_alpha * l1) * slot_w
    hit = argmax == labels
    if not with_grad:
        return loss, l1, hit, None, None
    sign = (q - p).sign()  # d|x|/dx, 0 at 0 as autograd's abs
    spread = (sign * q).sum(dim=-1, keepdim=True)  # (c, 1)
    onehot = torch.arange(z.shape[1], device=z.device) == labels[:, None]  # (c, V), fuses as a where
    grad = (ce_alpha * torch.where(onehot, q - 1, q) + l1_alpha * q * (sign - spread)) * slot_w[:, None]
    return loss, l1, hit, grad.to(base.dtype), grad.to(markov.dtype)


@dataclass
class _HeadWalk:
    """How ``_HeadTerms`` walks the supervised slots."""

    chunk_size: int
    kernel: object  # dspark_chunk_terms, or its compiled version
    fixed: bool  # every chunk chunk_size rows, the last one padded (one compiled shape)
    ce_alpha: float
    l1_alpha: float
    markov_dtype: torch.dtype  # the Markov term's matmuls run in it


def _head_walk(h, e, s, w2, weight, bias, labels, slot_w, walk: _HeadWalk, with_grad: bool):
    """sum w (a CE + b L1) over the M rows, their L1 (M,) and hits (M,), and with ``with_grad``
    the gradients of the sum for h (M, H), e (M, r) and W2 (V, r).

    Padding rows are zero inputs with label 0 and weight 0: finite terms times 0, zero gradient
    rows; their L1, hits and gradient rows are cut off at the end.
    """
    m = h.shape[0]
    pad = -m % walk.chunk_size if walk.fixed else 0
    if pad:
        h, e, s = (F.pad(x, (0, 0, 0, pad)) for x in (h, e, s))
        labels, slot_w = F.pad(labels, (0, pad)), F.pad(slot_w, (0, pad))
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    l1 = torch.empty(m + pad, dtype=torch.float32, device=h.device)
    hit = torch.empty(m + pad, dtype=torch.bool, device=h.device)
    grads = (torch.empty_like(h), torch.empty_like(e), torch.zeros_like(w2, dtype=torch.float32)) if with_grad else None
    w2_m = w2.to(walk.markov_dtype)  # (V, r)
    for start in range(0, m + pad, walk.chunk_size):
        sl = slice(start, start + walk.chunk_size)
        e_m = e[sl].to(walk.markov_dtype)  # (c, r)
        base = F.linear(h[sl].to(weight.dtype), weight, bias)  # (c, V) in the head's dtype
        markov = F.linear(e_m, w2_m)  # (c, V)
        teacher = F.linear(s[sl], weight, bias)  # (c, V)
        loss, l1[sl], hit[sl], grad_base, grad_markov = walk.kernel(
            base, markov, teacher, labels[sl], slot_w[sl], walk.ce_alpha, walk.l1_alpha, with_grad)
        total += loss.sum()
        if with_grad:
            grads[0][sl] = grad_base @ weight  # (c, H), into h's dtype
            grads[1][sl] = grad_markov @ w2_m  # (c, r), into e's dtype
            grads[2].add_(grad_markov.t() @ e_m)  # (V, r), summed in float32
    if grads is not None:
        grads = (grads[0][:m], grads[1][:m], grads[2].to(w2.dtype))
    return total, l1[:m], hit[:m], grads


class _HeadTerms(torch.autograd.Function):
    """sum_i w_i (a CE_i + b L1_i) of z_i = U h_i + W2 e_i, with gradients for h, e and W2
    computed during the forward (``_head_walk``) and scaled in backward; also returns L1 and
    the argmax hits, both without gradient."""

    @staticmethod
    def forward(ctx, h, e, w2, s, weight, bias, labels, slot_w, walk):
        # h (M, H) in the drafter's dtype, s (M, H) in the head's, e (M, r), labels (M,), slot_w (M,) float32
        with_grad = any(ctx.needs_input_grad[:3])
        total, l1, hit, grads = _head_walk(h, e, s, w2, weight, bias, labels, slot_w, walk, with_grad)
        ctx.save_for_backward(*(grads or ()))
        ctx.mark_non_differentiable(l1, hit)
        return total, l1, hit

    @staticmethod
    def backward(ctx, grad_total, _grad_l1, _grad_hit):
        scaled = tuple(g * grad_total.to(g.dtype) for g in ctx.saved_tensors)
        return (*scaled, None, None, None, None, None, None)


def dspark_loss_first(drafter, hidden: torch.Tensor, labels: torch.Tensor, block_ids: torch.Tensor,
                anchors: torch.Tensor, final: torch.Tensor, lm_head: torch.nn.Module, weights: torch.Tensor,
                chunk_size: int, alphas: DSparkLossWeights, index: torch.Tensor | None = None, *,
                fused: bool | None = None, compiled: bool = True) -> LossOutput:
    """The weighted DSpark loss of drafter outputs ``hidden`` (b, Q, H).

    ``drafter``: the DSparkDraftModel (its Markov and confidence heads); ``labels`` (b, Q)
    DSpark labels; ``block_ids`` (b, Q) the block inputs (the anchor token at slot 0);
    ``anchors`` (b, N); ``final`` (b, T, H) the target's final hidden states; ``weights``
    (B,) exp(-k/gamma). ``correct`` and ``count`` have B + 1 entries, entry k + 1 for slot k
    (the k+1-th token after the anchor, the position DFlash's slot k + 1 predicts), entry 0
    unused: the accuracy logs of both kinds then name the same token. ``index`` as
    ``dflash_loss``'s; ``fused`` the fixed-size chunks in the head's dtype (default: on CUDA),
    ``compiled`` False runs their function eagerly (tests, debugging).
    """
    rows = supervised_rows(drafter, hidden, labels, block_ids, weights, index)
    block_size, dtype = weights.numel(), lm_head.weight.dtype
    t_index = teacher_index(rows.index, anchors, block_size, final.shape[1])
    s = final.flatten(0, 1).index_select(0, t_index).to(dtype)  # (M, H)
    if fused is None:
        fused = hidden.is_cuda
    kernel = compiled_kernel(dspark_chunk_terms_first) if fused and compiled else dspark_chunk_terms_first
    w2 = drafter.markov_head.markov_w2.weight  # (V, r)
    # The walk's dtypes as dspark_loss's (the head's on the fused walk, W2's on the plain one).
    walk = _HeadWalk(chunk_size, kernel, fused, alphas.ce, alphas.l1, dtype if fused else w2.dtype)
    head_sum, l1, hit = _HeadTerms.apply(rows.h, rows.e, w2, s, lm_head.weight, getattr(lm_head, "bias", None),
                                         rows.y, rows.w, walk)
    return loss_output(drafter, rows, labels, block_size, alphas, head_sum, l1, hit)
