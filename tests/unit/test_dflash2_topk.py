"""The selector's candidates come from ``top_k_rows`` (training/loss.py), a top-k that looks at
the k segments of highest maximum only: the same values and columns as ``torch.topk`` on rows
of distinct values, whatever the vocabulary's size and wherever the top k lie, and the same
values where logits tie."""

import pytest
import torch

from dflash_train.contract import IGNORE_INDEX
from dflash_train.training.loss import TOP_K_SEGMENT, dflash_loss, top_k_rows

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("vocab", [40 * TOP_K_SEGMENT, 40 * TOP_K_SEGMENT + 77, 33 * TOP_K_SEGMENT + 1])
@pytest.mark.parametrize("k", [1, 16])
def test_top_k_rows_equals_torch_topk(vocab, k):
    g = torch.Generator().manual_seed(vocab + k)
    logits = torch.randn(64, vocab, generator=g)
    # Rows whose top k crowd together: all in one segment, all in the columns past the last
    # whole segment (when there are enough), spread one per segment, and the two halves of a
    # segment boundary.
    logits[1, 5 * TOP_K_SEGMENT: 5 * TOP_K_SEGMENT + k] += 10
    tail = vocab % TOP_K_SEGMENT
    if tail >= k:
        logits[2, vocab - tail: vocab - tail + k] += 10
    logits[3, torch.arange(k) * TOP_K_SEGMENT + 3] += 10
    logits[4, 7 * TOP_K_SEGMENT - k // 2: 7 * TOP_K_SEGMENT + (k + 1) // 2] += 10
    want = logits.topk(k, dim=-1)
    values, cols = top_k_rows(logits, k)
    assert torch.equal(values, want.values) and torch.equal(cols, want.indices)


def test_top_k_rows_keeps_the_top_values_when_logits_tie():
    """bf16 logits tie often: the values are topk's, and every column holds the value named."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(128, 50 * TOP_K_SEGMENT + 9, generator=g).bfloat16()
    logits[0, :200] = 3.0  # 200 equal maxima over two segments
    values, cols = top_k_rows(logits, 16)
    assert torch.equal(values, logits.topk(16, dim=-1).values)
    assert torch.equal(logits.gather(1, cols), values)
    assert all(len(set(row)) == 16 for row in cols.tolist())  # 16 distinct columns a row


def test_top_k_rows_with_few_segments_is_torch_topk():
    logits = torch.randn(4, 3 * TOP_K_SEGMENT, generator=torch.Generator().manual_seed(0))
    values, cols = top_k_rows(logits, 2)
    want = logits.topk(2, dim=-1)
    assert torch.equal(values, want.values) and torch.equal(cols, want.indices)


@pytest.mark.parametrize("fused", [False, True])
def test_dflash_loss_candidates_are_the_heads_top_k_at_a_large_vocabulary(fused):
    """Through the loss's walk (plain and fixed-size chunks), at a vocabulary of 37 segments and
    a ragged last one: the candidates are the head's top-k of every supervised slot."""
    g = torch.Generator().manual_seed(1)
    vocab, hidden_size, block = 37 * TOP_K_SEGMENT + 50, 24, 4
    head = torch.nn.Linear(hidden_size, vocab).requires_grad_(False)
    hidden = torch.randn(2, 6 * block, hidden_size, generator=g)
    labels = torch.randint(0, vocab, (2, 6 * block), generator=g)
    labels[:, ::block] = IGNORE_INDEX
    labels[1, -2:] = IGNORE_INDEX
    out = dflash_loss(hidden, labels, head, torch.tensor([0.0, 1.0, 0.7, 0.4]), 7, fused=fused, compiled=False,
                      top_k=16)
    index = (labels.flatten() != IGNORE_INDEX).nonzero().squeeze(1)
    want = head(hidden.flatten(0, 1)[index]).topk(16, dim=-1)
    assert torch.equal(out.candidates.tokens, want.indices)
    torch.testing.assert_close(out.candidates.logits, want.values, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_top_k_rows_on_cuda_equals_torch_topk():
    """At the recipe's vocabulary and a chunk of 1024 rows: the columns of distinct float32 logits,
    the values of bf16 ones (which tie); and the host never waits for the GPU."""
    logits = torch.randn(1024, 151936, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    top_k_rows(logits, 16)  # first calls outside the sync check (kernels load)
    torch.cuda.set_sync_debug_mode("error")
    try:
        values, cols = top_k_rows(logits, 16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = logits.topk(16, dim=-1)
    assert torch.equal(values, want.values) and torch.equal(cols, want.indices)
    half = logits.bfloat16()
    values, cols = top_k_rows(half, 16)
    assert torch.equal(values, half.topk(16, dim=-1).values) and torch.equal(half.gather(1, cols), values)
