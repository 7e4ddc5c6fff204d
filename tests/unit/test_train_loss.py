"""The chunked loss through the frozen LM head equals the plain full-logits loss."""

import pytest
import torch
import torch.nn.functional as F

from dflash_train import contract
from dflash_train.contract import IGNORE_INDEX
from dflash_train.training.loss import dflash_loss

B = 4
# Pinned: the loss of a fixed random case; a change here means the loss math changed.
PINNED_LOSS = 69.9794006


def _case(bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(8, 50, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(50, 8, generator=g))
        if bias:
            head.bias.copy_(torch.randn(50, generator=g))
    head.requires_grad_(False)
    hidden = torch.randn(2, 3 * B, 8, generator=g, requires_grad=True)  # 2 rows, 3 blocks of 4
    labels = torch.randint(0, 50, (2, 3 * B), generator=g)
    labels[:, ::B] = IGNORE_INDEX  # anchor slots
    labels[1, 5] = IGNORE_INDEX
    labels[0, 9:] = IGNORE_INDEX
    return head, hidden, labels


def _reference(head, hidden, labels, weights):
    logits = head(hidden).float()  # (b, Q, V): the full tensor the chunked loss avoids
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    w = weights.repeat(labels.shape[1] // B)[None].expand_as(labels).flatten()
    return (ce * w).sum(), logits.argmax(-1)


@pytest.mark.parametrize("chunk", [1, 3, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_loss_and_grad_match_full_logits(chunk, bias):
    head, hidden, labels = _case(bias)
    weights = contract.slot_weights(B, 2.0)
    out = dflash_loss(hidden, labels, head, weights, chunk)
    (grad,) = torch.autograd.grad(out.weighted_sum * 3.0, hidden)
    ref, argmax = _reference(head, hidden, labels, weights)
    (ref_grad,) = torch.autograd.grad(ref * 3.0, hidden)
    torch.testing.assert_close(out.weighted_sum, ref)
    torch.testing.assert_close(grad, ref_grad)
    torch.testing.assert_close(out.weight_sum, contract.loss_weight_sum(labels, weights))
    valid = labels != IGNORE_INDEX
    slot = torch.arange(labels.shape[1]) % B
    for k in range(B):
        sel = valid & (slot == k)
        assert out.count[k] == sel.sum()
        assert out.correct[k] == (argmax == labels)[sel].sum()


def test_loss_without_supervised_slots_is_zero_with_zero_grad():
    head, hidden, labels = _case(False)
    out = dflash_loss(hidden, torch.full_like(labels, IGNORE_INDEX), head, contract.slot_weights(B, 2.0), 4)
    out.weighted_sum.backward()
    assert out.weighted_sum == 0 and out.count.sum() == 0
    assert torch.count_nonzero(hidden.grad) == 0


def test_pinned_loss_value():
    head, hidden, labels = _case(False, seed=3)
    out = dflash_loss(hidden, labels, head, contract.slot_weights(B, 2.0), 5)
    assert out.weighted_sum.item() == pytest.approx(PINNED_LOSS, rel=1e-5)

