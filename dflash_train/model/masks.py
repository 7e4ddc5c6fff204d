"""Training attention masks for the concatenated-blocks layout.

Queries are N blocks of B slots, concatenated: query q belongs to block q // B, slot q % B.
Keys are `[C context features | N*B block tokens]`. Three implementations of one rule:
  * `reference_mask`: plain Python loops, the oracle the tests hold the others to;
  * `visible_mask` (in dflash.py, shared with inference): dense bool, the SDPA path;
  * `build_block_mask`: a flex-attention BlockMask built from the known structure, without
    evaluating a mask function over the whole (Q, C + Q) grid.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

from dflash_train.model.dflash import FULL_ATTENTION, SLIDING_ATTENTION, block_size_of, visible_mask

TILE = 128  # flex-attention's default sparse block size, for queries and keys


def reference_mask(anchors, context_len, block_size, doc_ids=None, sliding_window=None, causal_block=False):
    """The visibility rule spelled out one (query, key) pair at a time: (b, 1, Q, C + Q)."""
    b, n = anchors.shape
    q_len = n * block_size
    out = torch.zeros(b, 1, q_len, context_len + q_len, dtype=torch.bool)
    for r in range(b):
        for q in range(q_len):
            blk, slot = divmod(q, block_size)
            anchor = int(anchors[r, blk])
            for key in range(context_len + q_len):
                if key < context_len:
                    pos_gap = anchor + slot - key
                    ok = key < anchor
                    if doc_ids is not None:
                        ok = ok and int(doc_ids[r, key]) == int(doc_ids[r, min(anchor, context_len - 1)])
                else:
                    kblk, kslot = divmod(key - context_len, block_size)
                    pos_gap = slot - kslot
                    ok = kblk == blk and (not causal_block or kslot <= slot)
                if sliding_window is not None:
                    ok = ok and pos_gap < sliding_window
                out[r, 0, q, key] = ok
    return out


def _tiles(length: int) -> int:
    return (length + TILE - 1) // TILE


def _tile_min_max(x, tiles: int):
    """(b, L) -> per TILE-wide chunk min and max, each (b, tiles); the last chunk's missing
    elements are filled with values that change neither reduction."""
    info = torch.iinfo(x.dtype)
    pad = (x.shape[0], tiles * TILE - x.shape[1])

    def chunks(fill):  # torch.cat, not F.pad: F.pad passes the fill through a float (int64 max overflows)
        return torch.cat([x, x.new_full(pad, fill)], dim=1).view(x.shape[0], tiles, TILE)

    return chunks(info.max).amin(-1), chunks(info.min).amax(-1)


def _context_tiles(anchors, context_len, block_size, nq, k_start, k_end, doc_ids, sliding_window):
    """Context keys of each (query tile, key tile): (any visible, all visible), each (b, nq, nk).

    Key tile t holds context keys [k_start, c_end) with c_end = min(k_end, C). "Any" only
    needs to be a superset (it picks the tiles where mask_mod runs); "all" must be exact:
    the GPU kernel skips mask_mod on full tiles and treats every element as visible.
    """
    dev = anchors.device
    c_end = torch.clamp(k_end, max=context_len)  # (nk,)
    has_ctx = (k_start < context_len)[None, None]
    q_anchor = anchors.repeat_interleave(block_size, dim=1)  # (b, Q)
    a_lo, a_hi = _tile_min_max(q_anchor, nq)  # (b, nq)
    # strictly before the anchor: the last key c_end - 1 < smallest anchor <=> c_end <= a_lo
    ctx_any = has_ctx & (k_start < a_hi[..., None])
    ctx_all = has_ctx & (c_end <= a_lo[..., None])
    if doc_ids is not None:
        # a block's document is the one at its anchor (clamped, as in visible_mask)
        q_doc = doc_ids.gather(1, anchors.clamp(max=context_len - 1)).repeat_interleave(block_size, dim=1)
        qd_lo, qd_hi = (d[..., None] for d in _tile_min_max(q_doc, nq))  # (b, nq, 1)
        kd_lo, kd_hi = (d[:, None] for d in _tile_min_max(doc_ids, len(k_start)))  # (b, 1, nk)
        ctx_any = ctx_any & (kd_lo <= qd_hi) & (qd_lo <= kd_hi)
        ctx_all = ctx_all & (qd_lo == qd_hi) & (kd_lo == kd_hi) & (qd_lo == kd_lo)
    if sliding_window is not None:
        q_pos = q_anchor + torch.arange(block_size, device=dev).repeat(anchors.shape[1])  # (b, Q)
        p_lo, p_hi = (p[..., None] for p in _tile_min_max(q_pos, nq))  # (b, nq, 1)
        ctx_any = ctx_any & (p_lo - (c_end - 1) < sliding_window)  # the closest pair
        ctx_all = ctx_all & (p_hi - k_start < sliding_window)  # the farthest pair
    return ctx_any, ctx_all


def _block_tiles(context_len, block_size, q_len, k_start, k_end, sliding_window, causal_block):
    """Block keys of each (query tile, key tile): (any visible, all visible), each (nq, nk).

    Queries and block keys share one index space (block key C + i stands for query i), but
    tile edges need not fall on block edges (B = 10), so tiles are compared by the blocks
    they touch, not by their index ranges. All visible needs one block on both sides (only
    possible with a short last tile or B >= TILE), with the slot rules on top.
    """
    q_start = torch.arange(_tiles(q_len), device=k_start.device)[:, None] * TILE  # (nq, 1)
    q_last = torch.clamp(q_start + TILE, max=q_len) - 1
    b_start = torch.clamp(k_start - context_len, min=0)  # (nk,) first and last block key index
    b_last = k_end - 1 - context_len
    has_blk = k_end > context_len
    qb_lo, qb_hi = q_start // block_size, q_last // block_size  # blocks a tile touches
    kb_lo, kb_hi = b_start // block_size, b_last // block_size
    blk_any = has_blk & (kb_lo <= qb_hi) & (qb_lo <= kb_hi)
    blk_all = has_blk & (qb_lo == qb_hi) & (kb_lo == kb_hi) & (qb_lo == kb_lo)
    # inside one block the slots of a tile are contiguous: [start % B, last % B]
    if causal_block:
        blk_all = blk_all & (b_last % block_size <= q_start % block_size)
    if sliding_window is not None:
        blk_all = blk_all & (q_last % block_size - b_start % block_size < sliding_window)
    return blk_any, blk_all


def _tile_maps(anchors, context_len, block_size, doc_ids=None, sliding_window=None, causal_block=False):
    """Per (query tile, key tile), each (b, nq, nk) bool: partial (mask_mod runs) and full.

    Full is exact: a tile is full iff the dense mask is True on every element of it that
    exists (the last query and key tiles may be short). Partial covers every other tile with
    any visible element. A key tile may hold context and block keys; it is full only if
    both parts are. Padding anchors (moved to 0) see no context, so their tiles are never
    full on the context side.
    """
    q_len = anchors.shape[1] * block_size
    kv_len = context_len + q_len
    k_start = torch.arange(_tiles(kv_len), device=anchors.device) * TILE  # (nk,)
    k_end = torch.clamp(k_start + TILE, max=kv_len)
    ctx_any, ctx_all = _context_tiles(anchors, context_len, block_size, _tiles(q_len), k_start, k_end,
                                      doc_ids, sliding_window)
    blk_any, blk_all = _block_tiles(context_len, block_size, q_len, k_start, k_end, sliding_window, causal_block)
    has_ctx, has_blk = k_start < context_len, k_end > context_len
    full = (ctx_all | ~has_ctx) & (blk_all | ~has_blk)
    partial = (ctx_any | blk_any) & ~full
    return partial, full


def _to_indices(tile_map):
    """(b, nq, nk) bool -> counts (b, 1, nq) and key-tile indices (b, 1, nq, nk), hits first."""
    counts = tile_map.sum(-1, dtype=torch.int32)
    order = torch.argsort((~tile_map).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts[:, None], order[:, None]


def document_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """(b, C) index of the first token of each token's document (documents are contiguous runs)."""
    idx = torch.arange(doc_ids.shape[1], device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=1).values


def build_block_mask(anchors, context_len, block_size, doc_ids=None, sliding_window=None, causal_block=False):
    """A flex-attention BlockMask equal to `visible_mask` with the same arguments.

    Packed documents must be contiguous runs of ``doc_ids`` (as packing makes them): a block
    then sees exactly the context keys [start of its anchor's document, anchor), so mask_mod
    reads two per-block values instead of gathering a document id per key, which matters in
    the backward kernels, where mask_mod runs on every element of every partial tile.
    """
    b, n = anchors.shape
    q_len = n * block_size
    hi = anchors  # (b, N) context keys strictly before the anchor
    lo = None  # (b, N) first context key of the anchor's document
    if doc_ids is not None:
        lo = document_starts(doc_ids).gather(1, anchors.clamp(max=context_len - 1))

    def mask_mod(bi, _h, q, kv):
        blk, s = q // block_size, q % block_size
        anchor = hi[bi, blk]
        see_ctx = kv < anchor  # anchor <= C - 1, so these are context keys
        if lo is not None:
            see_ctx = see_ctx & (kv >= lo[bi, blk])
        kb = kv - context_len  # block key index; negative for context keys
        see_blk = (kb >= 0) & (kb // block_size == blk)
        if causal_block:
            see_blk = see_blk & (kb % block_size <= s)
        if sliding_window is not None:
            see_ctx = see_ctx & (anchor + s - kv < sliding_window)
            see_blk = see_blk & (s - kb % block_size < sliding_window)
        return see_ctx | see_blk

    partial, full = _tile_maps(anchors, context_len, block_size, doc_ids, sliding_window, causal_block)
    kv_num, kv_idx = _to_indices(partial)
    full_num, full_idx = _to_indices(full)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=TILE, mask_mod=mask_mod, seq_lengths=(q_len, context_len + q_len)
    )


def build_training_masks(config, anchors, anchor_valid, context_len, doc_ids=None, kind="flex") -> dict:
    """Masks for every layer type of a drafter config, keyed by layer type.

    anchors: (b, N) long; anchor_valid: (b, N) bool. Padding anchors are moved to index 0, so
    their (ignored) queries see only their own block and the softmax stays defined.
    """
    if kind not in ("flex", "dense"):
        raise ValueError(f"mask kind must be 'flex' or 'dense', got {kind!r}")
    block_size = block_size_of(config)  # the drafter's own rule: dflash_config wins
    anchors = anchors.masked_fill(~anchor_valid, 0)
    build = build_block_mask if kind == "flex" else visible_mask
    layer_types = getattr(config, "layer_types", None) or [FULL_ATTENTION]
    masks = {}
    if FULL_ATTENTION in layer_types:
        masks[FULL_ATTENTION] = build(anchors, context_len, block_size, doc_ids)
    if SLIDING_ATTENTION in layer_types:
        masks[SLIDING_ATTENTION] = build(
            anchors, context_len, block_size, doc_ids, sliding_window=config.sliding_window, causal_block=True
        )
    return masks
