"""Issue 38, round two: DSpark's and DFlash2's step parts rewritten after the 6aff139 profile,
each against the formulation it replaces (benchmarks/kinds_step_parts.py keeps and times them):
the selector's codebooks read with F.embedding instead of advanced indexing, the candidates'
segment maxima taken from the CUDA CE kernel's first pass, and DSpark's chunk function as a
Triton kernel. The Triton parts run on a GPU only (``-m gpu``); their checks take a device, so
the same checks run on a CPU under Triton's interpreter (TRITON_INTERPRET=1) where Triton is
installed."""

import pytest
import torch

from benchmarks.kinds_step_parts import pair_scores_indexed, zipf_tokens
from dflash_train.model.dflash2 import CandidateSelector
from dflash_train.training.dspark_loss import dspark_chunk_terms
from dflash_train.training.loss import TOP_K_SEGMENT, top_k_rows

pytestmark = pytest.mark.usefixtures("one_thread")


def _selector_grads(fn, selector, h, pred, cand, grad):
    h = h.detach().requires_grad_()
    scores = fn(selector, h, pred, cand)
    return [scores.detach(), *torch.autograd.grad(scores, [h, *selector.parameters()], grad)]


@pytest.mark.parametrize("rows", [1, 37, 300])
def test_selector_scores_by_embedding_equal_the_indexed_reads(rows):
    """Values and every gradient (h, P, A, B) in float32, with ids repeated as a step's top-K
    candidates repeat (Zipf: a few tokens in most rows, and within rows)."""
    g = torch.Generator().manual_seed(rows)
    vocab, hidden, rank, k = 500, 24, 8, 16
    torch.manual_seed(rows)
    selector = CandidateSelector(hidden, vocab, rank)
    with torch.no_grad():
        for p in selector.parameters():
            p.normal_(0, 0.5)
    h = torch.randn(rows, hidden, generator=g)
    pred, cand = zipf_tokens((rows,), vocab, g), zipf_tokens((rows, k), vocab, g)
    grad = torch.randn(rows, k, generator=g)
    got = _selector_grads(CandidateSelector.forward, selector, h, pred, cand, grad)
    want = _selector_grads(pair_scores_indexed, selector, h, pred, cand, grad)
    assert cand.unique().numel() < cand.numel()  # repeated ids, whose rows the backward sums
    assert got[4].abs().sum() > 0 and got[3].abs().sum() > 0  # gradients reach both codebooks
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_k_rows_given_its_segment_maxima_is_unchanged(dtype):
    """The maxima the CUDA kernel writes are the amax top_k_rows takes itself: given them, the same
    values and columns, on a vocabulary with a ragged tail."""
    g = torch.Generator().manual_seed(3)
    vocab = 40 * TOP_K_SEGMENT + 77
    logits = torch.randn(50, vocab, generator=g).to(dtype)
    logits[1, vocab - 20:] += 10  # the top in the tail past the last whole segment
    seg = logits.unfold(1, TOP_K_SEGMENT, TOP_K_SEGMENT).amax(dim=-1)  # (50, 40)
    values, cols = top_k_rows(logits, 16, seg)
    want_values, want_cols = top_k_rows(logits, 16)
    assert torch.equal(values, want_values) and torch.equal(cols, want_cols)
    assert torch.equal(values, logits.topk(16, dim=-1).values)


# ------------------------------------------------------------ the Triton kernels (GPU, or interpreter)
def check_ce_kernel_segment_maxima(device: str) -> None:
    """The CE kernel's first pass writes each whole segment's maximum, and its other outputs are
    those it gives without them (bit for bit)."""
    from dflash_train.training import ce_kernel

    g = torch.Generator(device).manual_seed(0)
    for vocab, dtype in ((151936 // 4, torch.bfloat16), (3 * ce_kernel.BLOCK + 300, torch.float32)):
        logits = (torch.randn(64, vocab, generator=g, device=device) * 4).to(dtype)
        logits[2, vocab - 3] = 80.0  # the largest logit in the tail, outside every whole segment
        labels = torch.randint(0, vocab, (64,), generator=g, device=device)
        w = torch.rand(64, generator=g, device=device)
        seg = torch.full((64, vocab // ce_kernel.SEGMENT), 7.0, dtype=dtype, device=device)
        with_seg = ce_kernel.fused_ce(logits, None, labels, w, True, segment_max=seg)
        plain = ce_kernel.fused_ce(logits, None, labels, w, True)
        assert torch.equal(seg, logits.unfold(1, ce_kernel.SEGMENT, ce_kernel.SEGMENT).amax(dim=-1))
        for a, b in zip(with_seg, plain, strict=True):
            assert torch.equal(a, b)
        values, cols = top_k_rows(logits, 16, seg)
        assert torch.equal(values, logits.topk(16, dim=-1).values) and torch.equal(logits.gather(1, cols), values)


def check_dspark_kernel(device: str) -> None:
    """The Triton chunk function against ``dspark_chunk_terms``: w (a CE + b L1), L1, hits and the
    gradient, with and without it, float32 and bf16, a ragged last block and a padding row of
    weight 0 (teacher row 0, as the walk pads)."""
    from dflash_train.training import dspark_kernel

    g = torch.Generator(device).manual_seed(1)
    for vocab, dtype in ((3 * dspark_kernel.BLOCK + 300, torch.float32), (151936 // 4, torch.bfloat16)):
        rows, positions = 24, 9
        z = (torch.randn(rows, vocab, generator=g, device=device) * 3).to(dtype)
        table = (torch.randn(positions, vocab, generator=g, device=device) * 3).to(dtype)
        lse = torch.logsumexp(table.float(), dim=-1)
        teacher_rows = torch.randint(0, positions, (rows,), generator=g, device=device)
        labels = torch.randint(0, vocab, (rows,), generator=g, device=device)
        labels[1] = z[1].float().argmax()  # a hit
        w = torch.rand(rows, generator=g, device=device)
        z[-1], teacher_rows[-1], labels[-1], w[-1] = 0, 0, 0, 0  # a padding row
        for with_grad in (True, False):
            got = dspark_kernel.dspark_terms(z, None, table, teacher_rows, lse, labels, w, 0.1, 0.9, with_grad)
            want = dspark_chunk_terms(z, None, table, teacher_rows, lse, labels, w, 0.1, 0.9, with_grad)
            torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
            assert torch.equal(got[2], want[2]) and got[2][1] and got[4] is None and want[4] is None
            if not with_grad:
                assert got[3] is None and want[3] is None
                continue
            assert got[3].dtype == dtype and torch.count_nonzero(got[3][-1]) == 0
            # bf16: the same float32 value rounds alike, so one bf16 step at most (2^-8 relative)
            tol = {"rtol": 8e-3, "atol": 1e-7} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-8}
            torch.testing.assert_close(got[3], want[3], **tol)


def check_dflash2_candidates_from_the_kernel(device: str) -> None:
    """Through the fused walk with the Triton kernel (segment maxima from its first pass): each
    supervised slot's candidates hold the head's top-k values, and keeping them changes neither
    the DFlash loss nor its gradient nor its hits (bit for bit)."""
    from dflash_train.contract import IGNORE_INDEX
    from dflash_train.training.loss import dflash_loss

    g = torch.Generator(device).manual_seed(2)
    vocab, hidden_size, block = 37 * TOP_K_SEGMENT + 50, 32, 4
    head = torch.nn.Linear(hidden_size, vocab, device=device).requires_grad_(False)
    hidden = torch.randn(2, 10 * block, hidden_size, generator=g, device=device, requires_grad=True)
    labels = torch.randint(0, vocab, (2, 10 * block), generator=g, device=device)
    labels[:, ::block] = IGNORE_INDEX
    weights = torch.tensor([0.0, 1.0, 0.7, 0.4], device=device)
    outs = [dflash_loss(hidden, labels, head, weights, 16, fused=True, top_k=k) for k in (0, 16)]
    grads = [torch.autograd.grad(o.weighted_sum, hidden)[0] for o in outs]
    assert torch.equal(outs[0].weighted_sum, outs[1].weighted_sum) and torch.equal(grads[0], grads[1])
    assert torch.equal(outs[0].correct, outs[1].correct)
    index = (labels.flatten() != IGNORE_INDEX).nonzero().squeeze(1)
    logits = head(hidden.detach().flatten(0, 1)[index])
    cand = outs[1].candidates
    assert torch.equal(cand.logits, logits.topk(16, dim=-1).values)
    assert torch.equal(logits.gather(1, cand.tokens), cand.logits)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("check", [check_ce_kernel_segment_maxima, check_dspark_kernel,
                                   check_dflash2_candidates_from_the_kernel])
def test_triton_kernels_on_cuda(check):
    check("cuda")
