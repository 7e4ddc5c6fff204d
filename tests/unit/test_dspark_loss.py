"""DSpark's closed-form chunked loss (training/dspark_loss.py) equals the loss written out over
full logits with autograd, in value and in the gradients of everything it trains: the
drafter's outputs, the Markov embedding W1, W2 and the confidence head. Plain chunks, fixed
(padded) chunks eagerly and compiled, float32 and bf16 heads."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dflash_train import contract
from dflash_train.contract import IGNORE_INDEX
from dflash_train.model.dspark import DSparkConfig, DSparkDraftModel
from dflash_train.training import dspark_loss as dspark_loss_module
from dflash_train.training.dspark_loss import DSparkLossWeights, dspark_chunk_terms, dspark_loss, previous_tokens
from tests.unit.test_train_loss import NEEDS_CXX

B, N, T, H, V, R = 4, 3, 12, 8, 50, 4  # block, blocks per row, row length, hidden, vocabulary, Markov rank
ANCHORS = torch.tensor([[0, 3, 7], [1, 2, 8]])  # (2, N): slot k reads the target after p + k <= 11 < T
# Supervised slots per block (DSpark cuts a block at its first unsupervised slot): full blocks,
# a block cut after its anchor slot, an empty one, so slots 0..3 are all supervised somewhere.
# M = 4 + 1 + 3 + 4 + 0 + 2 = 14: chunk 7 divides it, chunks 3 and 5 leave a ragged last chunk.
KEPT = [[4, 1, 3], [4, 0, 2]]
ALPHAS = DSparkLossWeights(0.3, 0.9, 0.7)


def loss_case(head_dtype=torch.float32, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    config = DSparkConfig(hidden_size=H, intermediate_size=16, num_attention_heads=1, num_key_value_heads=1,
                          head_dim=H, vocab_size=V, num_hidden_layers=1, num_target_layers=2, block_size=B,
                          markov_rank=R, dflash_config={"mask_token_id": 0, "target_layer_ids": [0]})
    drafter = DSparkDraftModel(config)
    with torch.no_grad():  # large enough to move the distributions away from uniform
        drafter.markov_head.markov_w1.weight.copy_(torch.randn(V, R, generator=g))
        drafter.markov_head.markov_w2.weight.copy_(torch.randn(V, R, generator=g))
        drafter.confidence_head.proj.weight.copy_(torch.randn(1, H + R, generator=g))
    head = nn.Linear(H, V, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g))
        if bias:
            head.bias.copy_(torch.randn(V, generator=g))
    head = head.to(head_dtype).requires_grad_(False)
    ids = torch.randint(1, V, (2, T), generator=g)
    labels = torch.full((2, N * B), IGNORE_INDEX)
    for r in range(2):
        for n, p in enumerate(ANCHORS[r].tolist()):
            for k in range(KEPT[r][n]):
                labels[r, n * B + k] = ids[r, p + k + 1]
    block_ids = torch.zeros(2, N * B, dtype=torch.long)
    block_ids[:, ::B] = ids.gather(1, ANCHORS)
    hidden = torch.randn(2, N * B, H, generator=g, requires_grad=True)
    final = torch.randn(2, T, H, generator=g)
    return drafter, head, hidden, labels, block_ids, final


def _reference(drafter, head, hidden, labels, block_ids, final, weights, alphas, markov_dtype=torch.float32):
    """The loss over full (b, Q, V) logits with autograd, the teacher of slot k of each block
    read at anchor + k by a loop, the Markov term's matmul in ``markov_dtype``: apart from the
    head's when the dtypes differ, else one matmul with it, [h ; e] [U ; W2]^T, rounded once."""
    dtype = head.weight.dtype
    valid = labels != IGNORE_INDEX
    prev = previous_tokens(labels, block_ids, B).clamp(min=0)  # unsupervised slots: any token, weight 0
    e = drafter.markov_head.embed(prev)  # (b, Q, r)
    w2 = drafter.markov_head.markov_w2.weight
    if markov_dtype == dtype:
        x = torch.cat([hidden.to(dtype), e.to(dtype)], dim=-1)  # (b, Q, H + r)
        z = F.linear(x, torch.cat([head.weight, w2.to(dtype)], dim=1), head.bias).float()  # (b, Q, V)
    else:
        z = head(hidden.to(dtype)).float() + F.linear(e.to(markov_dtype), w2.to(markov_dtype)).float()
    s = torch.zeros(2, N * B, H, dtype=dtype)
    for r in range(2):
        for n, p in enumerate(ANCHORS[r].tolist()):
            for k in range(B):
                s[r, n * B + k] = final[r, p + k]
    p_target = torch.softmax(head(s).float(), dim=-1)
    log_q = torch.log_softmax(z, dim=-1)
    ce = -log_q.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    l1 = (log_q.exp() - p_target).abs().sum(-1)
    bce = F.binary_cross_entropy_with_logits(drafter.confidence_head(hidden, e), (1 - 0.5 * l1.detach()).clamp(0, 1),
                                             reduction="none")
    w = weights.repeat(N)[None] * valid
    total = (w * (alphas.ce * ce + alphas.l1 * l1 + alphas.confidence * bce)).sum()
    hits = (z.argmax(-1) == labels) & valid
    slot = torch.arange(N * B).expand_as(labels) % B
    correct = torch.zeros(B + 1).index_add_(0, slot[valid] + 1, hits[valid].float())
    return total, correct


def _trained(drafter, hidden):
    m, c = drafter.markov_head, drafter.confidence_head.proj
    return {"hidden": hidden, "markov_w1": m.markov_w1.weight, "markov_w2": m.markov_w2.weight,
            "confidence.weight": c.weight, "confidence.bias": c.bias}


def _grads(total, drafter, hidden, scale=3.0):
    named = _trained(drafter, hidden)
    return dict(zip(named, torch.autograd.grad(total * scale, list(named.values()))))


def _check(head_dtype, chunk, fused, compiled, bias=True, **tol):
    drafter, head, hidden, labels, block_ids, final = loss_case(head_dtype, bias)
    weights = contract.slot_weights(B, 2.0, "dspark")
    out = dspark_loss(drafter, hidden, labels, block_ids, ANCHORS, final, head, weights, chunk, ALPHAS,
                      fused=fused, compiled=compiled)
    ref, ref_correct = _reference(drafter, head, hidden, labels, block_ids, final, weights, ALPHAS)
    torch.testing.assert_close(out.weighted_sum, ref, rtol=1e-6, atol=1e-5)
    got, want = _grads(out.weighted_sum, drafter, hidden), _grads(ref, drafter, hidden)
    for name in got:
        assert got[name].dtype == want[name].dtype, name
        # float32 sums in another order (the compiled chunks) err relative to the gradient's largest
        # entries, not to each entry: atol scales with the tensor (1.9e-6 on entries up to 3.8)
        scale = max(1.0, float(want[name].abs().max()))
        torch.testing.assert_close(got[name], want[name], msg=name, rtol=tol["rtol"], atol=tol["atol"] * scale)
    assert torch.equal(out.correct, ref_correct)
    assert out.count.tolist() == [0.0, 5.0, 4.0, 3.0, 2.0]  # entry k + 1: slot k, counted from KEPT
    torch.testing.assert_close(out.weight_sum, (weights.repeat(N)[None] * (labels != IGNORE_INDEX)).sum())
    return out


FP32 = {"rtol": 1e-5, "atol": 1e-6}


@pytest.mark.parametrize("chunk", [1, 5, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_plain_chunks_equal_the_autograd_loss(chunk, bias):
    _check(torch.float32, chunk, fused=False, compiled=False, bias=bias, **FP32)


@pytest.mark.parametrize(("chunk", "compiled"), [
    pytest.param(3, False, id="chunk3-eager"), pytest.param(7, False, id="chunk7-eager"),
    pytest.param(1000, False, id="chunk1000-eager"),
    pytest.param(3, True, id="chunk3-compiled", marks=NEEDS_CXX),
    pytest.param(7, True, id="chunk7-compiled", marks=NEEDS_CXX)])
def test_fixed_size_chunks_equal_the_autograd_loss(chunk, compiled):
    _check(torch.float32, chunk, fused=True, compiled=compiled, **FP32)


def test_bf16_head_equals_the_autograd_loss_on_plain_chunks():
    # The same bf16 logits both ways, and the gradient rounded to bf16 before the head's matmul
    # back, as autograd rounds it. At a backward scale of 1 the two round the same values (a
    # scale is applied before that rounding by autograd, after it here: both one bf16 step
    # from the exact value). The Markov term stays float32 on the plain walk, as its weights.
    drafter, head, hidden, labels, block_ids, final = loss_case(torch.bfloat16)
    weights = contract.slot_weights(B, 2.0, "dspark")
    out = dspark_loss(drafter, hidden, labels, block_ids, ANCHORS, final, head, weights, 5, ALPHAS, fused=False)
    ref, ref_correct = _reference(drafter, head, hidden, labels, block_ids, final, weights, ALPHAS)
    torch.testing.assert_close(out.weighted_sum, ref, rtol=1e-6, atol=1e-5)
    got, want = _grads(out.weighted_sum, drafter, hidden, 1.0), _grads(ref, drafter, hidden, 1.0)
    for name in got:
        torch.testing.assert_close(got[name], want[name], msg=name, **FP32)
    assert torch.equal(out.correct, ref_correct)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=NEEDS_CXX)])
def test_bf16_head_on_fixed_chunks_equals_the_autograd_loss_with_the_markov_matmul_in_bf16(compiled):
    """The fused walk (the CUDA default) keeps the Markov term in the head's dtype too: its
    logits are one bf16 matmul of [h ; W1[prev]] with [U ; W2], and the gradients of W1 and W2
    come from the bf16 gradient of the logits, as autocast's matmul would give them."""
    drafter, head, hidden, labels, block_ids, final = loss_case(torch.bfloat16)
    weights = contract.slot_weights(B, 2.0, "dspark")
    out = dspark_loss(drafter, hidden, labels, block_ids, ANCHORS, final, head, weights, 5, ALPHAS,
                      fused=True, compiled=compiled)
    ref, ref_correct = _reference(drafter, head, hidden, labels, block_ids, final, weights, ALPHAS, torch.bfloat16)
    torch.testing.assert_close(out.weighted_sum, ref, rtol=1e-6, atol=1e-5)
    got, want = _grads(out.weighted_sum, drafter, hidden, 1.0), _grads(ref, drafter, hidden, 1.0)
    # W2's gradient: each chunk's product rounded to bf16, summed in float32, against one bf16
    # product over all rows: a bf16 step apart (2^-8 relative; |grad| < 1 here).
    assert want["markov_w2"].abs().max() < 1
    torch.testing.assert_close(got.pop("markov_w2"), want.pop("markov_w2"), rtol=2 ** -8, atol=2 ** -9)
    for name in got:
        assert got[name].dtype == torch.float32, name
        torch.testing.assert_close(got[name], want[name], msg=name, **FP32)
    assert torch.equal(out.correct, ref_correct)


def test_without_grad_the_loss_is_the_same_and_no_gradient_is_kept(monkeypatch):
    drafter, head, hidden, labels, block_ids, final = loss_case()
    weights = contract.slot_weights(B, 2.0, "dspark")
    args = (drafter, hidden, labels, block_ids, ANCHORS, final, head, weights, 3, ALPHAS)
    walks = []  # with_grad of each walk: W2 is a parameter, yet under no_grad none is computed
    walk = dspark_loss_module._head_walk
    monkeypatch.setattr(dspark_loss_module, "_head_walk", lambda *a: walks.append(a[-1]) or walk(*a))
    with torch.no_grad():
        out = dspark_loss(*args, fused=True, compiled=False)
        plain = dspark_loss(*args, fused=False)
    assert not out.weighted_sum.requires_grad and walks == [False, False]
    torch.testing.assert_close(out.weighted_sum, dspark_loss(*args).weighted_sum.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(plain.weighted_sum, dspark_loss(*args, fused=False).weighted_sum.detach(),
                               rtol=1e-6, atol=0)
    assert walks[-2:] == [True, True]


def test_no_supervised_slot_gives_zero_loss_and_zero_gradients():
    drafter, head, hidden, _labels, block_ids, final = loss_case()
    labels = torch.full((2, N * B), IGNORE_INDEX)
    for fused in (False, True):
        out = dspark_loss(drafter, hidden, labels, block_ids, ANCHORS, final, head,
                          contract.slot_weights(B, 2.0, "dspark"), 3, ALPHAS, fused=fused, compiled=False)
        assert out.weighted_sum == 0 and out.count.sum() == 0
        grads = _grads(out.weighted_sum, drafter, hidden)
        assert all(torch.count_nonzero(g) == 0 for g in grads.values())


def test_chunk_gradient_is_autograds_of_the_chunk_terms():
    """The closed form d(a CE + b L1)/dz of one chunk against autograd on the same logits,
    with entries where both distributions are exactly 0 (sign 0), a padding row of weight 0,
    and teacher rows read from a table of 4 positions, two of them shared by two rows each;
    z given whole, or as the head's and the Markov term's parts."""
    g = torch.Generator().manual_seed(3)
    base, markov = (torch.randn(6, V, generator=g) for _ in range(2))
    table = torch.randn(4, V, generator=g)
    rows = torch.tensor([3, 1, 0, 2, 1, 3])
    base[0, :10], table[3, :10] = -1e4, -1e4  # q = p = 0 there
    labels, slot_w = torch.randint(0, V, (6,), generator=g), torch.rand(6, generator=g)
    slot_w[-1] = 0.0
    teacher = (table, rows, torch.logsumexp(table, dim=-1))
    z = (base + markov).requires_grad_()
    log_q = torch.log_softmax(z, -1)
    ref_l1 = (log_q.exp() - torch.softmax(table[rows], -1)).abs().sum(-1)
    ref = (0.1 * -log_q.gather(1, labels[:, None]).squeeze(1) + 0.9 * ref_l1) * slot_w
    (ref_grad,) = torch.autograd.grad(ref.sum(), z)
    for parts in ((base, markov), (base + markov, None)):
        loss, l1, hit, grad_z, grad_markov = dspark_chunk_terms(*parts, *teacher, labels, slot_w, 0.1, 0.9, True)
        torch.testing.assert_close(loss, ref.detach())
        torch.testing.assert_close(l1, ref_l1.detach())
        torch.testing.assert_close(grad_z, ref_grad, rtol=1e-5, atol=1e-7)
        assert grad_markov is (None if parts[1] is None else grad_z)  # one dtype: one tensor
        assert torch.count_nonzero(grad_z[0, :10]) == 0 and torch.count_nonzero(grad_z[-1]) == 0
        assert torch.equal(hit, (base + markov).argmax(-1) == labels)
        assert dspark_chunk_terms(*parts, *teacher, labels, slot_w, 0.1, 0.9, False)[3:] == (None, None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_compiled_loss_equals_the_eager_walk_and_never_waits_for_the_gpu():
    """The CUDA default (fixed chunks through torch.compile) on the case above with a bf16 head,
    against the eager walk on the same device; with the supervised index from the host, as the
    trainer passes it, no step of the loss waits for the GPU."""
    drafter, head, hidden, labels, block_ids, final = loss_case(torch.bfloat16)
    drafter, head, labels, block_ids, final = (x.cuda() for x in (drafter, head, labels, block_ids, final))
    hidden = hidden.detach().cuda().requires_grad_()
    weights = contract.slot_weights(B, 2.0, "dspark")  # on the host, like the trainer's
    index = (labels.cpu().flatten() != IGNORE_INDEX).nonzero().squeeze(1)
    args = (drafter, hidden, labels, block_ids, ANCHORS.cuda(), final, head, weights, 5, ALPHAS, index)
    eager = dspark_loss(*args, fused=True, compiled=False)
    want = _grads(eager.weighted_sum, drafter, hidden)
    _grads(dspark_loss(*args).weighted_sum, drafter, hidden)  # compiles outside the sync check
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = dspark_loss(*args)
        got = _grads(out.weighted_sum, drafter, hidden)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(out.weighted_sum, eager.weighted_sum, rtol=1e-5, atol=1e-5)
    for name in got:  # the same bf16 logits; inductor's float32 reductions may round differently
        torch.testing.assert_close(got[name], want[name], msg=name, rtol=1e-2, atol=1e-3)
    assert torch.equal(out.correct, eager.correct) and torch.equal(out.count, eager.count)
    assert torch.equal(out.blocks, eager.blocks) and torch.equal(out.accepted, eager.accepted)
