"""Issue 38: a DFlash2 selector's candidates on CUDA come from one Triton kernel
(training/topk_kernel.py) that picks each row's top k among the k segments of highest maximum.
It is held to ``torch.topk``: the same values, highest first, every column holding the value
named and no column twice; the same columns where the values are distinct. One check runs on
CUDA (``-m gpu``) and on a CPU under Triton's interpreter (TRITON_INTERPRET=1, read when the
kernel is built) where Triton is installed."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_train.training import ce_kernel, topk_kernel

SEGMENT = ce_kernel.SEGMENT
ROOT = Path(__file__).resolve().parents[2]
QWEN_VOCAB = 151936  # Qwen2.5's: 1,187 whole segments, no tail

pytestmark = pytest.mark.usefixtures("one_thread")


def _rows(n: int, vocab: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    """(n, vocab) random logits whose first rows are the hard cases: the top k all in one
    segment, all in the tail past the last whole segment (when there is one), one a segment,
    straddling a segment boundary, 300 equal maxima over three segments, a row of -inf but for
    three columns, and a row of equal values only."""
    g = torch.Generator(device).manual_seed(seed)
    x = torch.randn(n, vocab, generator=g, device=device) * 3
    tail = vocab % SEGMENT
    cases = [
        lambda r: r[5 * SEGMENT: 5 * SEGMENT + 16].add_(20),
        lambda r: r[vocab - tail:].add_(20) if tail else r[-16:].add_(20),
        lambda r: r[torch.arange(16, device=device) * SEGMENT + 3].add_(20),
        lambda r: r[7 * SEGMENT - 8: 7 * SEGMENT + 8].add_(20),
        lambda r: r[:300].fill_(25.0),
        lambda r: r.fill_(float("-inf")).index_fill_(0, torch.tensor([9, vocab // 2, vocab - 1], device=device), 1.0),
        lambda r: r.fill_(0.5),
    ]
    for row, case in zip(x, cases):
        case(row)
    return x.to(dtype)


def _assert_topk(logits: torch.Tensor, k: int, values: torch.Tensor, cols: torch.Tensor, distinct_rows) -> None:
    want = logits.topk(k, dim=-1)
    assert torch.equal(values, want.values.to(values.dtype))
    assert torch.equal(logits.gather(1, cols).to(values.dtype), values)
    assert all(len(set(row)) == k for row in cols.tolist())  # k distinct columns a row
    # where the values are distinct (random float32 rows) the columns are topk's too
    assert torch.equal(cols[distinct_rows], want.indices[distinct_rows])


def check_top_k_equals_torch_topk(device: str, kernel, row_counts=(1, 9, 64)) -> None:
    """The kernel against topk: Qwen's vocabulary and one with a ragged tail, bf16 and float32,
    k = 16 and a k that is no power of two, its segment maxima given (as the CE kernel writes
    them) or not, into new tensors and into float32 rows of a larger table (as the loss keeps
    its candidates)."""
    for vocab in (QWEN_VOCAB, 40 * SEGMENT + 77):
        for dtype in (torch.bfloat16, torch.float32):
            for n in row_counts:
                logits = _rows(n, vocab, dtype, device, seed=n)
                distinct = slice(7, None) if dtype == torch.float32 else slice(0, 0)
                for k in (16, 5):
                    values, cols = topk_kernel.top_k(logits, k, kernel=kernel)
                    assert values.dtype == dtype and cols.dtype == torch.long
                    _assert_topk(logits, k, values, cols, distinct)
                seg = topk_kernel.segment_maxima(logits)
                table_cols = torch.full((n + 3, 16), -1, dtype=torch.long, device=device)
                table_values = torch.zeros(n + 3, 16, device=device)
                topk_kernel.top_k(logits, 16, seg, values=table_values[2:-1], columns=table_cols[2:-1], kernel=kernel)
                _assert_topk(logits, 16, table_values[2:-1], table_cols[2:-1], distinct)
                assert (table_cols[[0, 1, -1]] == -1).all() and (table_values[[0, 1, -1]] == 0).all()


def test_top_k_refuses_too_few_segments():
    with pytest.raises(ValueError, match="fewer than k=16"):
        topk_kernel.top_k(torch.zeros(2, 15 * SEGMENT + 100), 16)


def test_top_k_under_the_interpreter_equals_torch_topk():
    """In a process of its own: Triton reads TRITON_INTERPRET when it is imported (its own tl.max
    is a jit function), and another test may have imported it already."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs Triton (its interpreter runs the kernel on a CPU)")
    script = ("import torch; torch.set_num_threads(1)\n"
              "from dflash_train.training import topk_kernel\n"
              "from tests.unit.test_topk_kernel import check_top_k_equals_torch_topk\n"
              "check_top_k_equals_torch_topk('cpu', topk_kernel._build(), row_counts=(1, 9))\n")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(filter(None, sys.path))}
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_top_k_on_cuda_equals_torch_topk():
    check_top_k_equals_torch_topk("cuda", None, row_counts=(1, 9, 64, 1024, 4096))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_top_k_rows_on_cuda_takes_the_kernel_and_never_syncs(dtype):
    """``loss.top_k_rows`` on CUDA at a chunk of 1024 rows, given the CE kernel's own segment
    maxima: topk's values (and columns, for distinct float32 values), with no host sync."""
    from dflash_train.training.loss import top_k_rows

    logits = _rows(1024, QWEN_VOCAB, dtype, "cuda", seed=3)
    labels = torch.zeros(1024, dtype=torch.long, device="cuda")
    w = torch.ones(1024, device="cuda")
    seg = torch.empty(1024, QWEN_VOCAB // SEGMENT, dtype=dtype, device="cuda")
    ce_kernel.fused_ce(logits, None, labels, w, False, segment_max=seg)
    top_k_rows(logits, 16, seg)  # first call outside the sync check (the kernel compiles)
    torch.cuda.set_sync_debug_mode("error")
    try:
        values, cols = top_k_rows(logits, 16, seg)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _assert_topk(logits, 16, values, cols, slice(7, None) if dtype == torch.float32 else slice(0, 0))
