"""DSpark's loss now (z = U h + W2 e as one matmul, the teacher's softmax once per position from
a table) against its first formulation, kept in benchmarks/dspark_loss_first.py (a head, a
Markov and a teacher matmul per supervised slot): the same loss, hits, L1-derived BCE and
gradients of everything trained, float32, on random inputs whose blocks overlap so that
positions teach several slots."""

import pytest
import torch
from torch import nn

from benchmarks.dspark_loss_first import dspark_loss_first
from dflash_train import contract
from dflash_train.contract import IGNORE_INDEX
from dflash_train.model.dspark import DSparkConfig, DSparkDraftModel
from dflash_train.training.dspark_loss import DSparkLossWeights, dspark_loss
from tests.unit.test_train_loss import NEEDS_CXX

pytestmark = pytest.mark.usefixtures("one_thread")

B, N, T, H, V, R = 4, 16, 24, 16, 70, 8  # block, blocks per row, row length, hidden, vocabulary, Markov rank
ALPHAS = DSparkLossWeights(0.3, 0.9, 0.7)


def random_case(seed: int, bias: bool, head_dtype=torch.float32):
    """Two rows of N sorted anchors in T positions (blocks overlap: a position teaches up to B
    slots), each block kept for a random number of slots (1 to B, two blocks 0), random heads
    and weights."""
    g = torch.Generator().manual_seed(seed)
    config = DSparkConfig(hidden_size=H, intermediate_size=16, num_attention_heads=1, num_key_value_heads=1,
                          head_dim=H, vocab_size=V, num_hidden_layers=1, num_target_layers=2, block_size=B,
                          markov_rank=R, dflash_config={"mask_token_id": 0, "target_layer_ids": [0]})
    drafter = DSparkDraftModel(config)
    with torch.no_grad():
        for p in (*drafter.markov_head.parameters(), *drafter.confidence_head.parameters()):
            p.copy_(torch.randn(p.shape, generator=g))
    head = nn.Linear(H, V, bias=bias)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    head = head.to(head_dtype).requires_grad_(False)
    ids = torch.randint(1, V, (2, T), generator=g)
    anchors = torch.stack([torch.randperm(T - B, generator=g)[:N].sort().values for _ in range(2)])  # (2, N)
    kept = torch.randint(1, B + 1, (2, N), generator=g)
    kept[0, 3] = kept[1, -1] = 0  # blocks without a supervised slot
    labels = torch.full((2, N * B), IGNORE_INDEX)
    for r in range(2):
        for n, p in enumerate(anchors[r].tolist()):
            for k in range(int(kept[r, n])):
                labels[r, n * B + k] = ids[r, p + k + 1]
    block_ids = torch.zeros(2, N * B, dtype=torch.long)
    block_ids[:, ::B] = ids.gather(1, anchors)
    hidden = torch.randn(2, N * B, H, generator=g, requires_grad=True)
    final = torch.randn(2, T, H, generator=g)
    return drafter, head, hidden, labels, block_ids, anchors, final


def _outputs(fn, drafter, hidden, *args, **kwargs):
    out = fn(drafter, hidden, *args, **kwargs)
    m, c = drafter.markov_head, drafter.confidence_head.proj
    params = [hidden, m.markov_w1.weight, m.markov_w2.weight, c.weight, c.bias]
    return out, torch.autograd.grad(out.weighted_sum * 3.0, params)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("chunk", "fused", "compiled"), [
    pytest.param(6, False, False, id="plain-chunk6"), pytest.param(1000, False, False, id="plain-chunk1000"),
    pytest.param(7, True, False, id="fixed-chunk7-eager"),
    pytest.param(7, True, True, id="fixed-chunk7-compiled", marks=NEEDS_CXX)])
def test_dspark_loss_equals_its_first_formulation(seed, bias, chunk, fused, compiled):
    drafter, head, hidden, labels, block_ids, anchors, final = random_case(seed, bias)
    weights = contract.slot_weights(B, 2.0, "dspark")
    args = (labels, block_ids, anchors, final, head, weights, chunk, ALPHAS)
    out, grads = _outputs(dspark_loss, drafter, hidden, *args, fused=fused, compiled=compiled)
    ref, ref_grads = _outputs(dspark_loss_first, drafter, hidden, *args, fused=fused, compiled=compiled)
    assert int((labels != IGNORE_INDEX).sum()) > 2 * T  # more supervised slots than positions
    torch.testing.assert_close(out.weighted_sum, ref.weighted_sum, rtol=1e-6, atol=1e-5)
    for name, a, b in zip(("hidden", "markov_w1", "markov_w2", "confidence.weight", "confidence.bias"), grads,
                          ref_grads, strict=True):
        assert a.abs().max() > 0, name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    for field in ("weight_sum", "correct", "count", "blocks", "accepted"):
        assert torch.equal(getattr(out, field), getattr(ref, field)), field


def test_bf16_head_on_plain_chunks_equals_its_first_formulation():
    """A CPU with a bf16 head keeps the head's and the Markov term's matmuls apart, as before:
    only the teacher's softmax moved (from its logits per slot to the table's rows and
    log-sum-exp), so everything agrees to float32 rounding."""
    drafter, head, hidden, labels, block_ids, anchors, final = random_case(2, True, torch.bfloat16)
    weights = contract.slot_weights(B, 2.0, "dspark")
    args = (labels, block_ids, anchors, final, head, weights, 5, ALPHAS)
    out, grads = _outputs(dspark_loss, drafter, hidden, *args, fused=False)
    ref, ref_grads = _outputs(dspark_loss_first, drafter, hidden, *args, fused=False)
    torch.testing.assert_close(out.weighted_sum, ref.weighted_sum, rtol=1e-6, atol=1e-5)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.equal(out.correct, ref.correct) and torch.equal(out.accepted, ref.accepted)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_compiled_loss_equals_its_first_formulation_at_two_table_sizes():
    """The CUDA default (compiled fixed chunks, the teacher's rows read from the table inside the
    compiled function) against the first formulation compiled, with a float32 head (so both are
    float32 through and through), at two row lengths: the table's row count changes and the
    compiled function must serve both."""
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # float32 matmuls, not TF32: float32 tolerances hold
    try:
        _compare_on_cuda()
    finally:
        torch.set_float32_matmul_precision(precision)


def _compare_on_cuda():
    for seq_pad in (0, 9):
        drafter, head, hidden, labels, block_ids, anchors, final = random_case(3, True)
        final = torch.cat([final, torch.randn(2, seq_pad, H)], dim=1)
        drafter, head, labels, block_ids, anchors, final = (x.cuda() for x in
                                                            (drafter, head, labels, block_ids, anchors, final))
        hidden = hidden.detach().cuda().requires_grad_()
        args = (labels, block_ids, anchors, final, head, contract.slot_weights(B, 2.0, "dspark"), 7, ALPHAS)
        out, grads = _outputs(dspark_loss, drafter, hidden, *args)
        ref, ref_grads = _outputs(dspark_loss_first, drafter, hidden, *args)
        torch.testing.assert_close(out.weighted_sum, ref.weighted_sum, rtol=1e-5, atol=1e-4)
        for a, b in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert torch.equal(out.correct, ref.correct) and torch.equal(out.accepted, ref.accepted)
