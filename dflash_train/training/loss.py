"""The DFlash loss: decayed per-slot cross-entropy through the frozen target LM head.

The head is large (vocab x hidden) and a step supervises up to num_anchors * B slots per
row, so full float32 logits would be [slots, vocab] at once (8192 x 152K x 4 bytes = 5 GB
for Qwen3). ``linear_cross_entropy`` walks the supervised slots in chunks and computes the
gradient with respect to the hidden states chunk by chunk during the forward, so at most
one chunk of logits exists at any time and nothing is recomputed in backward.

Two walks share that structure. The plain one (CPU) runs each step of the softmax as its
own op; on a GPU each of those ops is a full memory pass over a (chunk, vocab) float32
tensor while the matmuls are cheap. The fused one (CUDA by default) keeps the logits in the
head's dtype and computes loss, argmax hits and d loss / d logits in one compiled function
over fixed-size chunks, so it compiles once whatever the number of supervised slots.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dflash_train.contract import IGNORE_INDEX

# (logits, labels, slot_w, with_grad) -> (weighted CE sum, argmax hits, w * dCE/dlogits or None)
FusedKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool],
                       tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]


def _fused_ce(logits: torch.Tensor, labels: torch.Tensor, slot_w: torch.Tensor,
              with_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk of weighted CE from logits (c, V), labels (c,), slot weights (c,) float32.

    Written as plain torch so that inductor fuses it: float32 exists only in registers, the
    logits are read by one reduction and one pointwise kernel, and the gradient is written
    once, in the logits' dtype, ready for the matmul back to the hidden states.
    """
    x = logits.float()  # (c, V)
    top, argmax = x.max(dim=-1)  # (c,)
    exp = (x - top[:, None]).exp()  # (c, V)
    norm = exp.sum(dim=-1)  # (c,)
    target = x.gather(1, labels[:, None]).squeeze(1)  # (c,)
    total = ((top + norm.log() - target) * slot_w).sum()
    hit = argmax == labels
    if not with_grad:
        return total, hit, None
    # d CE / d logits = softmax - onehot, scaled by the slot weight. A where over an iota
    # comparison is pointwise, so it fuses; an index_put would be a separate kernel.
    onehot = torch.arange(x.shape[1], device=x.device) == labels[:, None]  # (c, V)
    probs = exp / norm[:, None]
    grad = torch.where(onehot, probs - 1, probs) * slot_w[:, None]
    return total, hit, grad.to(logits.dtype)


@functools.cache
def _compiled_fused_ce() -> FusedKernel:
    # Built on first use, not at import: importing dynamo costs seconds. Chunks have one fixed
    # shape, so each (chunk, vocab, dtype, with_grad) compiles once; dynamic=False keeps dynamo
    # from generalising to symbolic shapes after a second shape.
    return torch.compile(_fused_ce, dynamic=False, fullgraph=True)


def _plain_chunks(hidden, weight, bias, labels, slot_w, chunk_size, with_grad):
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    correct = torch.zeros(labels.shape, dtype=torch.bool, device=hidden.device)
    grad = torch.empty_like(hidden) if with_grad else None
    for start in range(0, hidden.shape[0], chunk_size):
        sl = slice(start, start + chunk_size)
        logits = F.linear(hidden[sl], weight, bias).float()  # (c, V): the only big tensor
        target = logits.gather(1, labels[sl, None]).squeeze(1)  # (c,)
        # logsumexp by hand: the exponentials are kept for the gradient, and on CPU this is
        # twice as fast as torch.logsumexp followed by a second exp pass.
        top, argmax = logits.max(dim=-1)  # (c,)
        probs = logits.sub_(top[:, None]).exp_()  # unnormalised, in place of the logits
        norm = probs.sum(dim=-1)  # (c,)
        total += ((top + norm.log() - target) * slot_w[sl]).sum()
        correct[sl] = argmax == labels[sl]
        if grad is not None:
            # d CE / d logits = softmax - onehot, scaled by the slot weight.
            probs /= norm[:, None]
            probs[torch.arange(probs.shape[0], device=probs.device), labels[sl]] -= 1
            probs *= slot_w[sl, None]
            grad[sl] = (probs.to(weight.dtype) @ weight).to(hidden.dtype)
    return total, correct, grad


def _fused_chunks(hidden, weight, bias, labels, slot_w, chunk_size, with_grad, kernel: FusedKernel):
    m = hidden.shape[0]
    # The last chunk is padded to the fixed size with zero hidden rows, label 0 and weight 0:
    # their CE is finite (logits = bias) and multiplied by 0, so they add exactly nothing;
    # their hits and gradient rows are cut off below.
    pad = -m % chunk_size
    labels, slot_w = F.pad(labels, (0, pad)), F.pad(slot_w, (0, pad))  # (M + pad,)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    correct = torch.empty(m, dtype=torch.bool, device=hidden.device)
    grad = torch.empty_like(hidden) if with_grad else None
    for start in range(0, m, chunk_size):
        sl = slice(start, start + chunk_size)
        rows = min(chunk_size, m - start)
        h = hidden[sl] if rows == chunk_size else F.pad(hidden[sl], (0, 0, 0, chunk_size - rows))  # (c, H)
        logits = F.linear(h, weight, bias)  # (c, V) in the head's dtype, never upcast in memory
        chunk_total, hit, grad_logits = kernel(logits, labels[sl], slot_w[sl], with_grad)
        total += chunk_total
        correct[sl] = hit[:rows]
        if grad is not None:
            grad[sl] = (grad_logits @ weight)[:rows].to(hidden.dtype)  # (rows, H)
    return total, correct, grad


class _LinearCrossEntropy(torch.autograd.Function):
    """sum_i w_i * CE(hidden_i @ W^T + b, label_i), with grad only for ``hidden``.

    ``kernel`` None walks the plain chunks; a ``FusedKernel`` walks fixed-size fused chunks.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, slot_w, chunk_size, kernel):
        # hidden (M, H), weight (V, H), labels (M,), slot_w (M,) float32
        args = (hidden, weight, bias, labels, slot_w, chunk_size, ctx.needs_input_grad[0])
        total, correct, grad = _plain_chunks(*args) if kernel is None else _fused_chunks(*args, kernel)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(correct)
        return total, correct

    @staticmethod
    def backward(ctx, grad_total, _grad_correct):
        (grad,) = ctx.saved_tensors
        return grad * grad_total.to(grad.dtype), None, None, None, None, None, None


@dataclass
class LossOutput:
    weighted_sum: torch.Tensor  # () float32, differentiable: sum of w_k * CE over valid slots
    weight_sum: torch.Tensor  # () float32: sum of w_k over valid slots of this micro-batch
    correct: torch.Tensor  # (B,) float32: argmax hits per slot
    count: torch.Tensor  # (B,) float32: supervised slots per slot index


def dflash_loss(hidden: torch.Tensor, labels: torch.Tensor, lm_head: nn.Module, weights: torch.Tensor,
                chunk_size: int, *, index: torch.Tensor | None = None, fused: bool | None = None,
                compiled: bool = True) -> LossOutput:
    """Weighted CE of drafter outputs ``hidden`` (b, Q, H) against ``labels`` (b, Q).

    ``weights`` (B,) are the per-slot weights; slot k of a block is query q with q % B == k.
    The caller divides ``weighted_sum`` by the (global) sum of valid weights.

    ``index`` (M,) long: flat indices into ``hidden.flatten(0, 1)`` of the supervised slots
    (label != IGNORE_INDEX), each once, computed by the caller on the host; in ascending order the sums match the
    masked ones bit for bit. Without it they are found from ``labels``, which makes a GPU
    wait for the count; with it nothing here waits for the device.
    ``fused`` picks the fused walk (default: on CUDA); ``compiled`` False runs its kernel
    eagerly (tests, debugging).
    """
    block_size, queries = weights.numel(), labels.shape[1]
    if index is None:
        index = (labels.flatten() != IGNORE_INDEX).nonzero().squeeze(1)  # (M,)
    # non_blocking: a host tensor's copy must not make the host wait for the GPU's queue.
    index = index.to(labels.device, non_blocking=True)
    slot = index % queries % block_size  # (M,)
    # The head runs in its own dtype (bf16 for a GPU target), whatever the drafter computed in.
    h = hidden.flatten(0, 1).index_select(0, index).to(lm_head.weight.dtype)  # (M, H)
    y = labels.flatten().index_select(0, index)  # (M,)
    w = weights.to(hidden.device, torch.float32, non_blocking=True).index_select(0, slot)  # (M,)
    if fused is None:
        fused = hidden.is_cuda
    kernel = (_compiled_fused_ce() if compiled else _fused_ce) if fused else None
    total, hit = _LinearCrossEntropy.apply(h, lm_head.weight, getattr(lm_head, "bias", None), y, w, chunk_size,
                                           kernel)
    # scatter_add, not bincount: bincount reads its maximum back to the host on CUDA.
    zeros = torch.zeros(block_size, dtype=torch.float32, device=hidden.device)
    count = zeros.scatter_add(0, slot, torch.ones_like(w))
    correct = zeros.scatter_add(0, slot, hit.float())
    return LossOutput(weighted_sum=total, weight_sum=w.sum(), correct=correct, count=count)
