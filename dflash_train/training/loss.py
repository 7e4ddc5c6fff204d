"""The DFlash loss: decayed per-slot cross-entropy through the frozen target LM head.

The head is large (vocab x hidden) and a step supervises up to num_anchors * B slots per
row, so full float32 logits would be [slots, vocab] at once (8192 x 152K x 4 bytes = 5 GB
for Qwen3). ``linear_cross_entropy`` walks the supervised slots in chunks and computes the
gradient with respect to the hidden states chunk by chunk during the forward, so at most
one chunk of logits exists at any time and nothing is recomputed in backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dflash_train.contract import IGNORE_INDEX


class _LinearCrossEntropy(torch.autograd.Function):
    """sum_i w_i * CE(hidden_i @ W^T + b, label_i), with grad only for ``hidden``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, slot_w, chunk_size):
        # hidden (M, H), weight (V, H), labels (M,), slot_w (M,) float32
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        correct = torch.zeros(labels.shape, dtype=torch.bool, device=hidden.device)
        grad = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
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
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(correct)
        return total, correct

    @staticmethod
    def backward(ctx, grad_total, _grad_correct):
        (grad,) = ctx.saved_tensors
        return grad * grad_total.to(grad.dtype), None, None, None, None, None


@dataclass
class LossOutput:
    weighted_sum: torch.Tensor  # () float32, differentiable: sum of w_k * CE over valid slots
    weight_sum: torch.Tensor  # () float32: sum of w_k over valid slots of this micro-batch
    correct: torch.Tensor  # (B,) float32: argmax hits per slot
    count: torch.Tensor  # (B,) float32: supervised slots per slot index


def dflash_loss(hidden: torch.Tensor, labels: torch.Tensor, lm_head: nn.Module, weights: torch.Tensor,
                chunk_size: int) -> LossOutput:
    """Weighted CE of drafter outputs ``hidden`` (b, Q, H) against ``labels`` (b, Q).

    ``weights`` (B,) are the per-slot weights; slot k of a block is query q with q % B == k.
    The caller divides ``weighted_sum`` by the (global) sum of valid weights.
    """
    block_size = weights.numel()
    slot = torch.arange(labels.shape[1], device=labels.device) % block_size  # (Q,)
    slot = slot.expand_as(labels)  # (b, Q)
    valid = labels != IGNORE_INDEX
    # The head runs in its own dtype (bf16 for a GPU target), whatever the drafter computed in.
    h = hidden[valid].to(lm_head.weight.dtype)  # (M, H)
    y, k = labels[valid], slot[valid]  # (M,), (M,)
    w = weights.to(hidden.device, torch.float32)[k]  # (M,)
    total, hit = _LinearCrossEntropy.apply(h, lm_head.weight, getattr(lm_head, "bias", None), y, w, chunk_size)
    count = torch.bincount(k, minlength=block_size).float()
    correct = torch.bincount(k, weights=hit.float(), minlength=block_size).float()
    return LossOutput(weighted_sum=total, weight_sum=w.sum(), correct=correct, count=count)
