"""The chunked loss through the frozen LM head equals the plain full-logits loss."""

import shutil

import pytest
import torch
import torch.nn.functional as F

from dflash_train import contract
from dflash_train.contract import IGNORE_INDEX
from dflash_train.training.loss import dflash_loss

B = 4
# Pinned: the loss of a fixed random case; a change here means the loss math changed.
PINNED_LOSS = 69.9794006


def loss_case(bias: bool, seed: int = 0):
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
    logits = head(hidden.to(head.weight.dtype)).float()  # (b, Q, V): the full tensor the chunked loss avoids
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    w = weights.repeat(labels.shape[1] // B)[None].expand_as(labels).flatten()
    return (ce * w).sum(), logits.argmax(-1)


@pytest.mark.parametrize("chunk", [1, 3, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_loss_and_grad_match_full_logits(chunk, bias):
    head, hidden, labels = loss_case(bias)
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
    head, hidden, labels = loss_case(False)
    out = dflash_loss(hidden, torch.full_like(labels, IGNORE_INDEX), head, contract.slot_weights(B, 2.0), 4)
    out.weighted_sum.backward()
    assert out.weighted_sum == 0 and out.count.sum() == 0
    assert torch.count_nonzero(hidden.grad) == 0


def test_pinned_loss_value():
    head, hidden, labels = loss_case(False, seed=3)
    out = dflash_loss(hidden, labels, head, contract.slot_weights(B, 2.0), 5)
    assert out.weighted_sum.item() == pytest.approx(PINNED_LOSS, rel=1e-5)



# The fused walk (the CUDA default) runs here on CPU, eagerly and through torch.compile. loss_case
# supervises M = 14 slots: chunk 7 divides M, chunks 3 and 1000 pad the last chunk. Each
# compiled (chunk, dtype, grad) is one inductor build, a few seconds on CPU, so the compiled
# cases stay few (and under dynamo's 8 recompiles of one function, past which it runs eagerly).
NEEDS_CXX = pytest.mark.skipif(shutil.which("g++") is None, reason="inductor builds CPU kernels with g++")
FUSED = [pytest.param(3, False, id="chunk3-eager"), pytest.param(7, False, id="chunk7-eager"),
         pytest.param(1000, False, id="chunk1000-eager"),
         pytest.param(3, True, id="chunk3-compiled", marks=NEEDS_CXX),
         pytest.param(7, True, id="chunk7-compiled", marks=NEEDS_CXX)]


def _run(head, hidden, labels, chunk, **kwargs):
    out = dflash_loss(hidden, labels, head, contract.slot_weights(B, 2.0), chunk, **kwargs)
    (grad,) = torch.autograd.grad(out.weighted_sum * 3.0, hidden)
    return out, grad


@pytest.mark.parametrize(("chunk", "compiled"), FUSED)
@pytest.mark.parametrize("bias", [False, True])
def test_fused_loss_and_grad_match_full_logits_and_plain_chunks(chunk, compiled, bias):
    head, hidden, labels = loss_case(bias)
    out, grad = _run(head, hidden, labels, chunk, fused=True, compiled=compiled)
    plain, plain_grad = _run(head, hidden, labels, chunk, fused=False)
    weights = contract.slot_weights(B, 2.0)
    ref, argmax = _reference(head, hidden, labels, weights)
    (ref_grad,) = torch.autograd.grad(ref * 3.0, hidden)
    torch.testing.assert_close(out.weighted_sum, ref)
    torch.testing.assert_close(grad, ref_grad)
    torch.testing.assert_close(out.weighted_sum, plain.weighted_sum)
    torch.testing.assert_close(grad, plain_grad)
    for field in ("weight_sum", "correct", "count"):
        assert torch.equal(getattr(out, field), getattr(plain, field)), field
        assert getattr(out, field).dtype == torch.float32
    assert out.correct.sum() == (argmax == labels)[labels != IGNORE_INDEX].sum()


@pytest.mark.parametrize(("chunk", "compiled"), [(3, False), (1000, False), pytest.param(3, True, marks=NEEDS_CXX)])
def test_fused_bf16_head_matches_plain_chunks_and_full_logits(chunk, compiled):
    # Every walk takes the same bf16 logits to float32, so the losses agree to float32
    # summation order. The gradient is rounded to bf16 (8 significant bits) before the
    # matmul by the head in each walk, so the hidden gradients agree to about 1%.
    head, hidden, labels = loss_case(True)
    head = head.to(torch.bfloat16)
    out, grad = _run(head, hidden, labels, chunk, fused=True, compiled=compiled)
    plain, plain_grad = _run(head, hidden, labels, chunk, fused=False)
    ref, _ = _reference(head, hidden, labels, contract.slot_weights(B, 2.0))
    (ref_grad,) = torch.autograd.grad(ref * 3.0, hidden)
    torch.testing.assert_close(out.weighted_sum, plain.weighted_sum, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.weighted_sum, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, plain_grad, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(grad, ref_grad, rtol=2e-2, atol=2e-2)
    assert torch.equal(out.correct, plain.correct) and torch.equal(out.count, plain.count)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=NEEDS_CXX)])
def test_fused_loss_without_grad_matches(compiled):
    head, hidden, labels = loss_case(True)
    weights = contract.slot_weights(B, 2.0)
    with torch.no_grad():
        out = dflash_loss(hidden, labels, head, weights, 3, fused=True, compiled=compiled)
    plain = dflash_loss(hidden, labels, head, weights, 3, fused=False)
    torch.testing.assert_close(out.weighted_sum, plain.weighted_sum.detach())
    assert torch.equal(out.correct, plain.correct) and torch.equal(out.count, plain.count)


def test_fused_loss_without_supervised_slots_is_zero_with_zero_grad():
    head, hidden, labels = loss_case(True)
    out, grad = _run(head, hidden, torch.full_like(labels, IGNORE_INDEX), 4, fused=True, compiled=False)
    assert out.weighted_sum == 0 and out.weight_sum == 0 and out.count.sum() == 0 and out.correct.sum() == 0
    assert torch.count_nonzero(grad) == 0


@pytest.mark.parametrize("fused", [False, True])
def test_index_gives_the_same_results_as_masking(fused):
    head, hidden, labels = loss_case(True)
    # The caller's host-side index: flat positions of the supervised slots, ascending.
    index = torch.tensor([i for i, y in enumerate(labels.flatten().tolist()) if y != IGNORE_INDEX])
    out, grad = _run(head, hidden, labels, 3, fused=fused, compiled=False)
    indexed, indexed_grad = _run(head, hidden, labels, 3, index=index, fused=fused, compiled=False)
    for field in ("weighted_sum", "weight_sum", "correct", "count"):
        assert torch.equal(getattr(indexed, field), getattr(out, field)), field
    assert torch.equal(indexed_grad, grad)


def cuda_case():
    """``loss_case`` in bf16 on the GPU, with the supervised index computed on the host as the
    trainer does."""
    head, hidden, labels = loss_case(True)
    index = (labels.flatten() != IGNORE_INDEX).nonzero().squeeze(1)
    return head.to("cuda", torch.bfloat16), hidden.detach().cuda().requires_grad_(), labels.cuda(), index


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_default_fused_walk_never_waits_for_the_gpu():
    head, hidden, labels, index = cuda_case()
    weights = contract.slot_weights(B, 2.0)  # on the host, like the trainer's
    plain, plain_grad = _run(head, hidden, labels, 3, fused=False)
    _run(head, hidden, labels, 3, index=index)  # compiles outside the sync check
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = dflash_loss(hidden, labels, head, weights, 3, index=index)
        (grad,) = torch.autograd.grad(out.weighted_sum * 3.0, hidden)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(out.weighted_sum, plain.weighted_sum, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, plain_grad, rtol=1e-2, atol=1e-2)
    assert torch.equal(out.correct, plain.correct) and torch.equal(out.count, plain.count)
    assert torch.equal(out.blocks, plain.blocks) and torch.equal(out.accepted, plain.accepted)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_triton_chunk_kernel_equals_the_reference_on_a_qwen_sized_vocabulary(dtype):
    """Qwen's 151,936 entries are 38 blocks of the kernel's 4096, the last one partial: the largest
    logit planted there, a label in the last column, a padding row of weight 0, with and
    without the gradient."""
    from dflash_train.training import ce_kernel
    from dflash_train.training.loss import fused_ce_reference

    torch.manual_seed(0)
    rows, vocab = 64, 151936
    logits = (torch.randn(rows, vocab, device="cuda") * 4).to(dtype)
    logits[1, vocab - 5] = 60.0
    labels = torch.randint(0, vocab, (rows,), device="cuda")
    labels[1], labels[2], labels[3] = vocab - 5, vocab - 1, logits[3].float().argmax()
    weights = torch.rand(rows, device="cuda")
    weights[-1] = 0.0
    loss, ce, hit, grad = ce_kernel.fused_ce(logits, None, labels, weights, True)
    ref_loss, ref_ce, ref_hit, ref_grad = fused_ce_reference(logits, None, labels, weights, True)
    torch.testing.assert_close(ce, ref_ce, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-4)
    assert loss[-1] == 0 and torch.count_nonzero(grad[-1]) == 0
    assert grad.dtype == dtype
    # bf16: the same float32 value rounds alike, so one bf16 step at most (2^-8 relative)
    tol = {"rtol": 8e-3, "atol": 1e-7} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-9}
    torch.testing.assert_close(grad, ref_grad, **tol)
    assert hit[1] and hit[3] and ref_hit[1] and ref_hit[3]
    x = logits.float()
    unique = (x == x.max(1, keepdim=True).values).sum(1) == 1  # rows whose argmax is not a tie
    assert torch.equal(hit[unique], ref_hit[unique])
    no_grad = ce_kernel.fused_ce(logits, None, labels, weights, False)
    assert no_grad[3] is None and torch.equal(no_grad[1], ce) and torch.equal(no_grad[2], hit)


def _fresh_tensors_walk(monkeypatch):
    """The plain walk as it was before its CPU buffers: a new tensor for every chunk."""
    from dflash_train.training import loss as loss_mod

    monkeypatch.setattr(loss_mod, "_head_logits", lambda h, w, b: F.linear(h, w, b).float())
    monkeypatch.setattr(loss_mod, "_in_head_dtype", lambda probs, dtype: probs.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_the_cpu_walks_reused_buffers_change_no_bit(dtype, bias, monkeypatch):
    # Cases of 7, 3 and then 7 supervised-slot chunks: a smaller chunk reads the first rows
    # of buffers a larger one filled, a larger one grows them.
    cases = []
    for seed, chunk in ((1, 1000), (2, 3), (3, 1000)):
        head, hidden, labels = loss_case(bias, seed)
        cases.append((head.to(dtype), hidden, labels, chunk))

    def run_all():
        out = []
        for head, hidden, labels, chunk in cases:
            r = dflash_loss(hidden, labels, head, contract.slot_weights(B, 2.0), chunk)
            (grad,) = torch.autograd.grad(r.weighted_sum, hidden)
            out.append((r.weighted_sum, r.correct, grad))
        return out

    reused = run_all()
    with monkeypatch.context() as m:
        _fresh_tensors_walk(m)
        fresh = run_all()
    for a, b in zip(reused, fresh):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_cpu_scratch_buffers_are_reused_and_grown():
    from dflash_train.training.loss import _Scratch

    scratch = _Scratch()
    big = scratch.get("head", 8, 50, torch.float32)
    small = scratch.get("head", 3, 50, torch.float32)
    assert small.data_ptr() == big.data_ptr() and small.shape == (3, 50) and small.is_contiguous()
    grown = scratch.get("head", 9, 50, torch.float32)
    assert grown.shape == (9, 50) and scratch.buffers[("head", torch.float32)].shape == (9, 50)
    assert scratch.get("head", 2, 50, torch.bfloat16).dtype == torch.bfloat16  # one buffer per dtype
