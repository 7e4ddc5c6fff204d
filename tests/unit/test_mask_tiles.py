"""The flex BlockMask's tile maps, held to the dense rule tile by tile.

On GPU the compiled flex kernel skips mask_mod on "full" tiles and treats every element of
them as visible, and it never visits a tile that is in neither map. On CPU the unfused path
evaluates mask_mod over the whole grid and ignores both maps, so attention outputs cannot
show a wrong map there; these tests read the maps back instead. Full tiles must be exactly
the tiles where the dense mask is all True (a full tile with one False element leaks, on
GPU only; an all-True tile left partial only costs speed), and partial | full must cover
every tile with any True element (a missing tile silently drops visible keys on GPU).
"""

from types import SimpleNamespace

import pytest
import torch

from torch.nn.attention.flex_attention import create_mask

from dflash_train.data.packing import PAD_DOC
from dflash_train.model.dflash import FULL_ATTENTION, SLIDING_ATTENTION, visible_mask
from dflash_train.model.masks import TILE, build_block_mask, build_training_masks

# Chosen against the "aligned" layout (runs of 8 anchors spaced 1 or 2 starting at a tile
# edge, B = 16): the farthest (slot, key) pair of such a run and the key tile just before it
# is 128 + 7 * spacing + 15 apart, i.e. 150 (visible) or 157 (exactly one too far).
WINDOW = 157
PAD_TAIL = 20  # right padding (PAD_DOC) at the end of packed rows


def _tile_map(num_blocks, indices, num_key_tiles):
    """BlockMask (b, 1, nq) counts and (b, 1, nq, nk) indices -> (b, nq, nk) bool."""
    listed = torch.arange(indices.shape[-1]) < num_blocks[..., None]  # (b, 1, nq, nk)
    out = torch.zeros(*indices.shape[:-1], num_key_tiles + 1, dtype=torch.bool)
    out.scatter_(-1, torch.where(listed, indices.long(), num_key_tiles), True)
    return out[:, 0, :, :num_key_tiles]


def _dense_tiles(dense):
    """(b, 1, Q, K) bool -> per tile (any True, all True over the elements that exist)."""
    b, _, q, k = dense.shape
    nq, nk = -(-q // TILE), -(-k // TILE)
    grid = (0, nk * TILE - k, 0, nq * TILE - q)  # missing elements: neutral for any / all
    any_true = torch.nn.functional.pad(dense[:, 0], grid, value=False).view(b, nq, TILE, nk, TILE)
    all_true = torch.nn.functional.pad(dense[:, 0], grid, value=True).view(b, nq, TILE, nk, TILE)
    return any_true.any(4).any(2), all_true.all(4).all(2)


def assert_exact_tiles(block_mask, dense):
    any_true, all_true = _dense_tiles(dense)
    nk = any_true.shape[-1]
    full = _tile_map(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, nk)
    partial = _tile_map(block_mask.kv_num_blocks, block_mask.kv_indices, nk)
    # and mask_mod itself, which decides inside partial tiles, on every element
    b, _, q_len, kv_len = dense.shape
    elements = create_mask(block_mask.mask_mod, b, None, q_len, kv_len, device="cpu")
    assert torch.equal(elements.expand_as(dense), dense)
    leaking = (full & ~all_true).nonzero().tolist()
    assert not leaking, f"full tiles (row, q tile, k tile) with a hidden element: {leaking}"
    slow = (all_true & ~full).nonzero().tolist()
    assert not slow, f"all-visible tiles (row, q tile, k tile) not marked full: {slow}"
    dropped = (any_true & ~(partial | full)).nonzero().tolist()
    assert not dropped, f"tiles (row, q tile, k tile) with visible keys in neither map: {dropped}"
    assert not (partial & full).any()


def _doc_ids(rows, ctx, g, aligned):
    """(rows, ctx) packed documents with right padding; boundaries at a tile edge or random."""
    out = torch.full((rows, ctx), PAD_DOC)
    real = ctx - PAD_TAIL
    for r in range(rows):
        cuts = [3 * TILE] if aligned else sorted(torch.randperm(real - 40, generator=g)[:2].add(20).tolist())
        for d, (lo, hi) in enumerate(zip([0] + cuts, cuts + [real])):
            out[r, lo:hi] = d
    return out


def _anchors(layout, rows, n, ctx, g, packed):
    """(rows, n) sorted anchors inside the real tokens (p + 1 < T), and their validity."""
    real = ctx - PAD_TAIL if packed else ctx
    valid = torch.ones(rows, n, dtype=torch.bool)
    out = []
    for r in range(rows):
        if layout == "clustered":  # two dense clusters: whole query tiles of nearby anchors
            starts = torch.randint(TILE, real - 4 * n, (2,), generator=g).sort().values
            pool = torch.cat([torch.arange(s, s + 2 * n) for s in starts.tolist()]).unique()
            pool = pool[pool < real - 1]
        elif layout == "aligned":  # runs of 8 anchors (one query tile at B = 16) starting at or just before an edge
            spacing = 2 if r == 0 else 1
            runs = [TILE * j - (j % 2) + spacing * torch.arange(8) for j in range(1, real // TILE + 1)]
            rest = torch.arange(runs[-1][-1] + 2, real - 1)
            rest = rest[torch.randperm(rest.numel(), generator=g)[: n - 8 * len(runs)]]
            out.append(torch.cat(runs + [rest]).sort().values)
            continue
        else:
            pool = torch.arange(real - 1)
        out.append(pool[torch.randperm(pool.numel(), generator=g)[:n]].sort().values)
    anchors = torch.stack(out)
    if layout == "padding":  # collate's padding blocks: invalid, moved to 0 by build_training_masks
        valid[:, -n // 4:] = False
        anchors = torch.cat([anchors[:, : n - n // 4], torch.zeros(rows, n // 4, dtype=torch.long)], 1)
    return anchors, valid


RULES = [(None, False), (None, True), (WINDOW, False), (WINDOW, True)]  # (sliding window, causal block)
LAYOUTS = ["random", "clustered", "aligned", "padding"]


@pytest.mark.parametrize("window,causal", RULES)
@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_full_tiles_are_exactly_the_all_visible_tiles(layout, packed, window, causal):
    # Q = 44 * 16 = 704 and C + Q = 1304: both last tiles are short
    ctx, n, block = 600, 44, 16
    g = torch.Generator().manual_seed(LAYOUTS.index(layout) * 10 + packed)
    doc_ids = _doc_ids(2, ctx, g, aligned=layout in ("clustered", "aligned")) if packed else None
    anchors, _ = _anchors(layout, 2, n, ctx, g, packed)
    dense = visible_mask(anchors, ctx, block, doc_ids, window, causal)
    assert_exact_tiles(build_block_mask(anchors, ctx, block, doc_ids, window, causal), dense)
    if layout in ("clustered", "aligned") and window is None:
        assert _dense_tiles(dense)[1].any()  # the case does exercise full tiles


# Shapes where block keys matter: a last query tile and a last key tile that hold one block
# only (C + Q = 522: the last key tile is block 8, slots 6..15), blocks straddling tile
# edges (B = 10; C a multiple of 128 puts a key tile edge where a block crosses a query tile
# edge), and blocks wider than a tile (B = 160: query tile 3 holds slots 64..159
# of block 2 and key tile 7 its slots 56..159, at most 103 apart, so a window of 103 makes
# that tile one slot short of full). The window replaces WINDOW in these shapes.
SHAPES = [(378, 9, 16, WINDOW), (512, 30, 10, WINDOW), (520, 3, 160, 103)]


@pytest.mark.parametrize("windowed,causal", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("ctx,n,block,window", SHAPES)
def test_tiles_with_block_keys(ctx, n, block, window, packed, windowed, causal):
    g = torch.Generator().manual_seed(ctx)
    doc_ids = _doc_ids(2, ctx, g, aligned=False) if packed else None
    anchors, _ = _anchors("random", 2, n, ctx, g, packed)
    window = window if windowed else None
    dense = visible_mask(anchors, ctx, block, doc_ids, window, causal)
    assert_exact_tiles(build_block_mask(anchors, ctx, block, doc_ids, window, causal), dense)


def test_packed_documents_are_contiguous_runs():
    # mask_mod reads a block's context range [document start, anchor): right for packed rows,
    # whose documents are contiguous runs; ids that come back later are not a packed row.
    ctx, n, block = 600, 44, 16
    anchors, _ = _anchors("aligned", 2, n, ctx, torch.Generator().manual_seed(7), packed=False)
    doc_ids = torch.zeros(2, ctx, dtype=torch.long)
    doc_ids[:, 150:200] = 1
    doc_ids[:, 200:] = 2
    dense = visible_mask(anchors, ctx, block, doc_ids)
    assert_exact_tiles(build_block_mask(anchors, ctx, block, doc_ids), dense)


def test_training_masks_with_padding_anchors_have_exact_tiles():
    ctx, n, block = 640, 40, 16
    g = torch.Generator().manual_seed(5)
    doc_ids = _doc_ids(2, ctx, g, aligned=True)
    anchors, valid = _anchors("padding", 2, n, ctx, g, packed=True)
    config = SimpleNamespace(block_size=block, layer_types=[SLIDING_ATTENTION, FULL_ATTENTION], sliding_window=300)
    masks = build_training_masks(config, anchors, valid, ctx, doc_ids)
    moved = anchors.masked_fill(~valid, 0)
    assert_exact_tiles(masks[FULL_ATTENTION], visible_mask(moved, ctx, block, doc_ids))
    assert_exact_tiles(masks[SLIDING_ATTENTION], visible_mask(moved, ctx, block, doc_ids, 300, True))
