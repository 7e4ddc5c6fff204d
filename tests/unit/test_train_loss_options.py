"""Distillation and D-PACE position weights equal plain full-logits references (values and
gradients), on the plain walk and on the fused walk, eagerly and compiled."""

import math

import pytest
import torch
import torch.nn.functional as F

from dflash_train import contract
from dflash_train.contract import IGNORE_INDEX
from dflash_train.training.loss import Distillation, dflash_loss, dpace_weights, soft_target_index
from tests.unit.test_train_loss import NEEDS_CXX, B, cuda_case, loss_case

# Each row of loss_case holds 3 blocks of 4 slots over T = 12 positions; slot k >= 1 of the block
# at anchor p reads the target's distribution after p + k - 1 <= 9 < T.
ANCHORS = torch.tensor([[0, 3, 7], [1, 2, 6]])
T = 12


def _teacher(seed: int = 1) -> torch.Tensor:
    return torch.randn(2, T, 8, generator=torch.Generator().manual_seed(seed))  # (b, T, H)


def _plain_loop_soft_targets(head, teacher_hidden, labels):
    """(b, Q, V) target logits per block slot, found by an explicit loop over blocks and slots."""
    s = head(teacher_hidden).float()  # (b, T, V): the full tensor the chunked loss avoids
    out = torch.zeros(labels.shape + (s.shape[-1],))
    for r in range(labels.shape[0]):
        for n, p in enumerate(ANCHORS[r].tolist()):
            for k in range(1, B):
                out[r, n * B + k] = s[r, p + k - 1]  # the distribution whose next token is x[p + k]
    return out


def _plain_loop_dpace(ce, labels, alpha):
    """(b, Q) D-PACE weights by the paper's formula, block by block."""
    q = (1 - alpha) * torch.exp(-ce.detach()) + alpha
    w = torch.zeros_like(ce)
    for r in range(labels.shape[0]):
        for blk in range(labels.shape[1] // B):
            slots = [blk * B + k for k in range(B) if labels[r, blk * B + k] != IGNORE_INDEX]
            for j in slots:
                total = 0.0
                for m in (m for m in slots if m >= j):
                    total += math.prod(float(q[r, i]) for i in slots if i <= m)
                w[r, j] = total
    return w


def _reference(head, hidden, labels, weights, teacher_hidden=None, a=0.0, t=1.0, dpace_alpha=None):
    z = head(hidden.to(head.weight.dtype)).float()  # (b, Q, V)
    valid = labels != IGNORE_INDEX
    ce = F.cross_entropy(z.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                         reduction="none").view(labels.shape)
    loss = ce
    if teacher_hidden is not None:
        s = _plain_loop_soft_targets(head, teacher_hidden, labels)
        kl = F.kl_div(F.log_softmax(z / t, -1), F.log_softmax(s / t, -1), log_target=True, reduction="none").sum(-1)
        loss = (1 - a) * ce + a * t * t * kl
    if dpace_alpha is None:
        w = weights.repeat(labels.shape[1] // B)[None].expand_as(labels)
    else:
        w = _plain_loop_dpace(ce, labels, dpace_alpha)
    return (loss * w * valid).sum()


def _run(head, hidden, labels, chunk, teacher=None, a=0.0, t=1.0, **kwargs):
    distill = None if teacher is None else Distillation(teacher, ANCHORS, a, t)
    out = dflash_loss(hidden, labels, head, contract.slot_weights(B, 2.0), chunk, distill=distill, **kwargs)
    (grad,) = torch.autograd.grad(out.weighted_sum * 3.0, hidden)
    return out, grad


def _check(out, grad, ref, hidden):
    (ref_grad,) = torch.autograd.grad(ref * 3.0, hidden)
    torch.testing.assert_close(out.weighted_sum, ref)
    torch.testing.assert_close(grad, ref_grad)


@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])  # M = 14: 7 divides it, 3 does not
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("a", [0.0, 0.5, 1.0])
def test_distillation_matches_full_logits(a, bias, chunk):
    head, hidden, labels = loss_case(bias)
    teacher = _teacher()
    out, grad = _run(head, hidden, labels, chunk, teacher, a)
    _check(out, grad, _reference(head, hidden, labels, contract.slot_weights(B, 2.0), teacher, a), hidden)
    torch.testing.assert_close(out.weight_sum, contract.loss_weight_sum(labels, contract.slot_weights(B, 2.0)))


@pytest.mark.parametrize("t", [0.5, 2.0])
def test_distillation_temperature_matches_full_logits(t):
    head, hidden, labels = loss_case(True)
    teacher = _teacher()
    out, grad = _run(head, hidden, labels, 3, teacher, 0.5, t)
    _check(out, grad, _reference(head, hidden, labels, contract.slot_weights(B, 2.0), teacher, 0.5, t), hidden)


def test_distillation_weight_zero_is_the_hard_label_loss_bit_for_bit():
    head, hidden, labels = loss_case(True)
    hard, hard_grad = _run(head, hidden, labels, 3)
    zero, zero_grad = _run(head, hidden, labels, 3, _teacher(), 0.0)
    assert torch.equal(hard.weighted_sum, zero.weighted_sum) and torch.equal(hard_grad, zero_grad)


def test_distilling_from_the_drafter_itself_costs_nothing():
    # Soft targets equal to the drafter's own distribution: KL 0, its gradient 0. Row 0's
    # blocks read disjoint positions (row 1's overlap), so only row 0 is supervised.
    head, hidden, labels = loss_case(False)
    labels[1] = IGNORE_INDEX
    teacher = torch.zeros(2, T, 8)
    for r in range(1):
        for n, p in enumerate(ANCHORS[r].tolist()):
            for k in range(1, B):
                teacher[r, p + k - 1] = hidden[r, n * B + k].detach()
    soft, soft_grad = _run(head, hidden, labels, 3, teacher, 1.0)
    assert abs(soft.weighted_sum.item()) < 1e-5
    assert soft_grad.abs().max() < 1e-5


def test_soft_target_index_points_at_the_position_before_the_label():
    labels = torch.zeros(2, 3 * B, dtype=torch.long)
    index = torch.arange(labels.numel())
    got = soft_target_index(index, ANCHORS, B, T).view(2, 3, B)
    for r in range(2):
        for n, p in enumerate(ANCHORS[r].tolist()):
            for k in range(B):
                assert got[r, n, k] == r * T + p + k - 1


@pytest.mark.parametrize("chunk", [1, 3, 1000])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("a", [0.0, 0.5])
def test_dpace_matches_plain_loop_reference(a, bias, chunk):
    head, hidden, labels = loss_case(bias)
    teacher = _teacher() if a else None
    out, grad = _run(head, hidden, labels, chunk, teacher, a, dpace_alpha=0.5)
    ref = _reference(head, hidden, labels, None, teacher, a, dpace_alpha=0.5)
    _check(out, grad, ref, hidden)
    # The normaliser: blocks with at least one supervised slot (loss_case leaves 5 of 6).
    assert out.weight_sum == 5


def test_dpace_weights_pinned_by_hand():
    # Block 0: q = 0.5, 0.8, 0.2 at slots 1..3 -> q~ = 0.75, 0.9, 0.6 (alpha 0.5); reach
    # 0.75, 0.675, 0.405; w = 0.75 + 0.675 + 0.405, 0.675 + 0.405, 0.405.
    # Block 1: slot 2 unsupervised (q~ = 1, no credit): reach 0.75 at 1, 0.45 at 3.
    q = torch.tensor([0.5, 0.8, 0.2, 0.5, 0.2])
    block = torch.tensor([0, 0, 0, 1, 1])
    slot = torch.tensor([1, 2, 3, 1, 3])
    w = dpace_weights(-q.log(), block, slot, num_blocks=2, block_size=4, alpha=0.5)
    torch.testing.assert_close(w, torch.tensor([1.83, 1.08, 0.405, 1.2, 0.45]))
    # alpha 1: every q~ is 1, so w_j counts the supervised slots from j on.
    w1 = dpace_weights(-q.log(), block, slot, num_blocks=2, block_size=4, alpha=1.0)
    torch.testing.assert_close(w1, torch.tensor([3.0, 2.0, 1.0, 2.0, 1.0]))


FUSED = [pytest.param(3, False, id="chunk3-eager"), pytest.param(7, False, id="chunk7-eager"),
         pytest.param(3, True, id="chunk3-compiled", marks=NEEDS_CXX),
         pytest.param(7, True, id="chunk7-compiled", marks=NEEDS_CXX)]


@pytest.mark.parametrize(("chunk", "compiled"), FUSED)
def test_fused_distillation_matches_full_logits_and_plain_walk(chunk, compiled):
    head, hidden, labels = loss_case(True)
    teacher = _teacher()
    out, grad = _run(head, hidden, labels, chunk, teacher, 0.5, fused=True, compiled=compiled)
    plain, plain_grad = _run(head, hidden, labels, chunk, teacher, 0.5, fused=False)
    _check(out, grad, _reference(head, hidden, labels, contract.slot_weights(B, 2.0), teacher, 0.5), hidden)
    torch.testing.assert_close(out.weighted_sum, plain.weighted_sum)
    torch.testing.assert_close(grad, plain_grad)
    for field in ("weight_sum", "correct", "count"):
        assert torch.equal(getattr(out, field), getattr(plain, field)), field


@pytest.mark.parametrize(("chunk", "compiled"), [(3, False), pytest.param(3, True, marks=NEEDS_CXX)])
@pytest.mark.parametrize("a", [0.0, 0.5])
def test_fused_dpace_matches_plain_loop_reference(a, chunk, compiled):
    head, hidden, labels = loss_case(True)
    teacher = _teacher() if a else None
    out, grad = _run(head, hidden, labels, chunk, teacher, a, fused=True, compiled=compiled, dpace_alpha=0.5)
    _check(out, grad, _reference(head, hidden, labels, None, teacher, a, dpace_alpha=0.5), hidden)


def test_fused_bf16_distillation_matches_plain_walk():
    # As for the hard-label loss: the same bf16 logits in both walks, the gradient rounded
    # to bf16 before the matmul back, so gradients agree to about 1%.
    head, hidden, labels = loss_case(True)
    head = head.to(torch.bfloat16)
    teacher = _teacher()
    out, grad = _run(head, hidden, labels, 3, teacher, 0.5, fused=True, compiled=False)
    plain, plain_grad = _run(head, hidden, labels, 3, teacher, 0.5, fused=False)
    torch.testing.assert_close(out.weighted_sum, plain.weighted_sum, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, plain_grad, rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_distillation_and_dpace_never_wait_for_the_gpu():
    head, hidden, labels, index = cuda_case()
    distill = Distillation(_teacher().cuda().bfloat16(), ANCHORS.cuda(), 0.5)
    weights = contract.slot_weights(B, 2.0)
    kwargs = dict(index=index, distill=distill, dpace_alpha=0.5)
    dflash_loss(hidden, labels, head, weights, 3, **kwargs)  # compiles outside the sync check
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = dflash_loss(hidden, labels, head, weights, 3, **kwargs)
        torch.autograd.grad(out.weighted_sum, hidden)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=NEEDS_CXX)])
def test_fused_distillation_with_temperature_matches_full_logits(compiled):
    head, hidden, labels = loss_case(True)
    teacher = _teacher()
    out, grad = _run(head, hidden, labels, 3, teacher, 0.5, 2.0, fused=True, compiled=compiled)
    _check(out, grad, _reference(head, hidden, labels, contract.slot_weights(B, 2.0), teacher, 0.5, 2.0), hidden)
