"""DSpark's loss (``drafter.kind=dspark``), DeepSpec's ``compute_dspark_loss`` in our terms.

For slot k (0-based) of the block at anchor p, with label y = x[p + k + 1], the gold
previous token prev = x[p + k] (teacher forcing), the drafter's output h, the target's final
hidden state s at position p + k (the target's distribution for x[p + k + 1]) and the frozen
LM head U:
    z = U h + W2 W1[prev]                  the Markov-corrected draft logits
    CE = -log softmax(z)[y]
    L1 = sum_v |softmax(z)_v - softmax(U s)_v|        (the full L1, 2 x total variation)
    BCE = BCE_with_logits(conf(h, W1[prev]), clamp(1 - L1 / 2, 0, 1) detached)
    loss = sum_slots w (a CE + b L1 + c BCE) / sum_slots w,  w = exp(-k / gamma)
with (a, b, c) = loss.dspark_{ce,l1,confidence}_alpha (DeepSpec: 0.1, 0.9, 1.0). The
denominator is the trainer's global loss normaliser, as for DFlash.

Memory: the two (slots, V) logit tensors exist one chunk of ``chunk_size`` slots at a time;
each chunk runs under activation checkpointing, so its logits are recomputed in backward
instead of being kept (the price: the head's matmuls run twice).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dflash_train.contract import ANCHOR_SLOT, IGNORE_INDEX
from dflash_train.training.loss import LossOutput


@dataclass
class DSparkLossWeights:
    ce: float = 0.1
    l1: float = 0.9
    confidence: float = 1.0


def previous_tokens(labels: torch.Tensor, block_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """(b, Q) the gold token before each slot's label: the anchor for slot 0, else the label
    of the slot before. Real tokens wherever a slot is supervised (labels are cut at the first
    unsupervised slot of a block, contract.dspark_block_labels)."""
    prev = labels.roll(1, dims=1)
    first = (torch.arange(labels.shape[1], device=labels.device) % block_size) == ANCHOR_SLOT
    return torch.where(first[None], block_ids, prev)


def teacher_index(index: torch.Tensor, anchors: torch.Tensor, block_size: int, seq_len: int) -> torch.Tensor:
    """(M,) flat indices into the target's (b * T) positions: slot k of the block at anchor p
    is taught by the target's distribution after position p + k, the one predicting its label."""
    block = index // block_size
    row = index // (anchors.shape[1] * block_size)
    return row * seq_len + anchors.flatten().index_select(0, block) + index % block_size


def _chunk_terms(h, e, s, y, weight, bias, w2):
    """One chunk: (c,) CE, (c,) L1 and (c,) argmax hits. h (c, H) drafter outputs, e (c, r)
    W1[prev], s (c, H) target final hidden states, y (c,) labels."""
    # The head in its own dtype (the target's), the Markov bias in the drafter's.
    z = F.linear(h, weight, bias).float() + F.linear(e, w2).float()  # (c, V)
    log_q = torch.log_softmax(z, dim=-1)
    ce = -log_q.gather(1, y[:, None]).squeeze(1)
    p_target = torch.softmax(F.linear(s, weight, bias).float(), dim=-1)  # (c, V), no gradient
    l1 = (log_q.exp() - p_target).abs().sum(dim=-1)
    return ce, l1, z.argmax(dim=-1) == y


def dspark_loss(drafter, hidden: torch.Tensor, labels: torch.Tensor, block_ids: torch.Tensor,
                anchors: torch.Tensor, final: torch.Tensor, lm_head: torch.nn.Module, weights: torch.Tensor,
                chunk_size: int, alphas: DSparkLossWeights, index: torch.Tensor | None = None) -> LossOutput:
    """The weighted DSpark loss of drafter outputs ``hidden`` (b, Q, H).

    ``drafter``: the DSparkDraftModel (its Markov and confidence heads); ``labels`` (b, Q)
    DSpark labels; ``block_ids`` (b, Q) the block inputs (the anchor token at slot 0);
    ``anchors`` (b, N); ``final`` (b, T, H) the target's final hidden states; ``weights``
    (B,) exp(-k/gamma). ``correct`` and ``count`` have B + 1 entries, entry k + 1 for slot k
    (the k+1-th token after the anchor, the position DFlash's slot k + 1 predicts), entry 0
    unused: the accuracy logs of both kinds then name the same token.
    """
    block_size = weights.numel()
    if index is None:
        index = (labels.flatten() != IGNORE_INDEX).nonzero().squeeze(1)  # (M,)
    index = index.to(labels.device, non_blocking=True)
    slot = index % labels.shape[1] % block_size  # (M,)
    dtype = lm_head.weight.dtype
    h = hidden.flatten(0, 1).index_select(0, index)  # (M, H)
    y = labels.flatten().index_select(0, index)  # (M,)
    prev = previous_tokens(labels, block_ids, block_size).flatten().index_select(0, index)  # (M,)
    e = drafter.markov_head.embed(prev)  # (M, r)
    t_index = teacher_index(index, anchors, block_size, final.shape[1])
    s = final.flatten(0, 1).index_select(0, t_index).to(dtype)  # (M, H)
    w = weights.to(hidden.device, torch.float32).index_select(0, slot)  # (M,)
    w2 = drafter.markov_head.markov_w2.weight
    ce, l1, hits = [], [], []
    for start in range(0, index.numel(), chunk_size):
        sl = slice(start, start + chunk_size)
        args = (h[sl].to(dtype), e[sl], s[sl], y[sl], lm_head.weight, getattr(lm_head, "bias", None), w2)
        c_ce, c_l1, c_hit = checkpoint(_chunk_terms, *args, use_reentrant=False) if torch.is_grad_enabled() \
            else _chunk_terms(*args)
        ce.append(c_ce)
        l1.append(c_l1)
        hits.append(c_hit)
    zero = hidden.new_zeros(0, dtype=torch.float32)
    ce, l1 = (torch.cat(ce) if ce else zero), (torch.cat(l1) if l1 else zero)
    hit = torch.cat(hits) if hits else zero.bool()
    accept = (1 - 0.5 * l1.detach()).clamp(0, 1)  # the chance the slot is accepted, given its prefix was
    conf = drafter.confidence_head(h, e)  # (M,)
    bce = F.binary_cross_entropy_with_logits(conf, accept, reduction="none")
    total = (w * (alphas.ce * ce + alphas.l1 * l1 + alphas.confidence * bce)).sum()
    zeros = torch.zeros(block_size + 1, dtype=torch.float32, device=hidden.device)
    count = zeros.scatter_add(0, slot + 1, torch.ones_like(w))
    correct = zeros.scatter_add(0, slot + 1, hit.float())
    return LossOutput(weighted_sum=total, weight_sum=w.sum(), correct=correct, count=count)
