"""The engine's decode attention (data_gen/engine_attention.py): the flex BlockMask names
exactly the cache blocks that hold each row's visible keys (against a plain loop over the
columns), compiled flex_attention reads no other block, and its output equals SDPA's over the
same rows within 1e-5, for rows of very different lengths, full and sliding-window attention."""

import pytest
import torch

from data_gen.engine_attention import DECODE_BLOCK, decode_attention, kv_blocks, visible

B, HKV, G, D = 8, 2, 3, 16
LENGTH = 4 * DECODE_BLOCK + 40  # not a multiple of the block: the last block is short
# Positions from a first token to the last column, on and beside block edges.
POS = [0, 1, DECODE_BLOCK - 1, DECODE_BLOCK, DECODE_BLOCK + 1, 300, 2 * DECODE_BLOCK + 77, LENGTH - 1]
LIVE = [True, True, True, True, False, True, True, True]


def reference_blocks(pos: int, live: bool, window: int | None, block: int) -> list[int]:
    """The blocks holding the columns row `pos` sees, by a loop over every column."""
    if not live:
        return []
    return sorted({c // block for c in range(pos + 1) if window is None or c > pos - window})


@pytest.mark.parametrize("window", [None, 1, 5, DECODE_BLOCK, 200, 10_000])
@pytest.mark.parametrize("block", [DECODE_BLOCK, 16])
def test_each_row_reads_exactly_the_blocks_holding_its_keys(window, block):
    pos, live = torch.tensor(POS), torch.tensor(LIVE)
    count, indices = kv_blocks(pos, live, LENGTH, window, block)
    total = -(-LENGTH // block)
    assert indices.shape == (B, total) and int(indices.min()) >= 0 and int(indices.max()) < total
    for row in range(B):
        want = reference_blocks(POS[row], LIVE[row], window, block)
        assert int(count[row]) == len(want), (row, window)
        assert indices[row, :len(want)].tolist() == want, (row, window)
    if window is None:  # the rule: ceil((pos + 1) / block) blocks a live row
        assert count.tolist() == [-(-(p + 1) // block) if alive else 0 for p, alive in zip(POS, LIVE)]


def test_visible_columns_are_the_rows_keys():
    seen = visible(torch.tensor([0, 3, 9]), 10, window=4)
    assert seen.int().tolist() == [[1, 0, 0, 0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0, 0, 0],
                                   [0, 0, 0, 0, 0, 0, 1, 1, 1, 1]]


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HKV, G, D, generator=g)
    k, v = (torch.randn(B, HKV, LENGTH, D, generator=g) for _ in range(2))
    return q, k, v


def _attend(kind, q, k, v, window):
    pos, live = torch.tensor(POS), torch.tensor(LIVE)
    return decode_attention(kind, q, k, v, pos, live, LENGTH, window, D**-0.5, {})


@pytest.mark.parametrize("window", [None, 100])
def test_flex_equals_sdpa_on_every_live_row(window):
    q, k, v = _inputs()
    flex, sdpa = _attend("flex", q, k, v, window), _attend("sdpa", q, k, v, window)
    live = torch.tensor(LIVE)
    assert flex.shape == sdpa.shape == (B, HKV, G, D)
    torch.testing.assert_close(flex[live], sdpa[live], atol=1e-5, rtol=1e-5)
    assert torch.equal(flex[~live], torch.zeros_like(flex[~live])), "a finished row reads nothing"


def test_flex_reads_no_block_outside_the_rows_own():
    """NaN in every column outside a row's blocks leaves flex's output equal to the clean one;
    NaN inside a block it reads, past the row's position, reaches it (the check can see reads)."""
    q, k, v = _inputs(1)
    clean = _attend("flex", q, k, v, 100)
    count, indices = kv_blocks(torch.tensor(POS), torch.tensor(LIVE), LENGTH, 100)
    read = torch.zeros(B, LENGTH, dtype=torch.bool)
    for row in range(B):
        for blk in indices[row, :count[row]].tolist():
            read[row, blk * DECODE_BLOCK:(blk + 1) * DECODE_BLOCK] = True
    poisoned_k, poisoned_v = k.clone(), v.clone()
    poisoned_k[~read[:, None, :].expand(B, HKV, LENGTH)] = float("nan")
    poisoned_v[~read[:, None, :].expand(B, HKV, LENGTH)] = float("nan")
    assert torch.equal(_attend("flex", q, poisoned_k, poisoned_v, 100), clean)
    row = POS.index(300)  # its block 2 holds columns 256-383; column 301 is past its position
    poisoned_v[row, :, 301] = float("nan")
    assert torch.isnan(_attend("flex", q, poisoned_k, poisoned_v, 100)[row]).all()


@pytest.mark.parametrize("kind, window, read, held", [
    ("sdpa", None, 4 * 320, 1 + 128 + 301), ("flex", None, (1 + 1 + 3) * DECODE_BLOCK, 1 + 128 + 301),
    ("sdpa", 100, 4 * 320, 1 + 100 + 100), ("flex", 100, (1 + 1 + 2) * DECODE_BLOCK, 1 + 100 + 100)])
def test_the_profile_counts_the_columns_each_kernel_reads(kind, window, read, held):
    """benchmarks/engine_profile.py's bandwidth: sdpa reads `width` columns of every row, the
    finished one too; flex the blocks of the live rows; the rows hold what they see."""
    from benchmarks.engine_profile import kv_columns

    pos, live = torch.tensor([0, 127, 128, 300]), torch.tensor([True, True, False, True])
    assert kv_columns(kind, pos, live, 320, 600, window) == (read, held)
