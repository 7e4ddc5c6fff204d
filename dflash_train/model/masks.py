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

from dflash_train.model.dflash import FULL_ATTENTION, SLIDING_ATTENTION, visible_mask

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


def _tile_maps(anchors, context_len, block_size, exact_ctx: bool):
    """Per (query tile, key tile): any key visible (partial) and all keys visible (full).

    Context tile t is reachable from a query tile if it starts before the largest anchor in
    the tile, and fully visible if it ends at or before the smallest one (only when the rule
    has no per-key refinement, i.e. no documents and no sliding window). Block keys of a
    query tile lie in the same index range shifted by C, so only those tiles are reachable.
    """
    b, n = anchors.shape
    q_len = n * block_size
    kv_len = context_len + q_len
    nq, nk = _tiles(q_len), _tiles(kv_len)
    q_anchor = anchors.repeat_interleave(block_size, dim=1)  # (b, Q)
    pad = nq * TILE - q_len
    hi = torch.nn.functional.pad(q_anchor, (0, pad), value=0).view(b, nq, TILE).amax(-1)  # (b, nq)
    lo = torch.nn.functional.pad(q_anchor, (0, pad), value=2**62).view(b, nq, TILE).amin(-1)
    k_start = torch.arange(nk, device=anchors.device) * TILE  # (nk,)
    k_end = torch.clamp(k_start + TILE, max=kv_len)
    ctx_part = k_start[None, None] < hi.clamp(max=context_len)[..., None]  # (b, nq, nk)
    ctx_full = (k_end[None, None] <= lo[..., None]) & (k_end <= context_len)[None, None]
    if not exact_ctx:
        ctx_full = torch.zeros_like(ctx_full)
    q_start = torch.arange(nq, device=anchors.device) * TILE
    blk_lo = context_len + q_start  # block keys of query tile i: [C + i*T, C + min((i+1)*T, Q))
    blk_hi = context_len + torch.clamp(q_start + TILE, max=q_len)
    blk_part = (k_start[None] < blk_hi[:, None]) & (k_end[None] > blk_lo[:, None])  # (nq, nk)
    partial = (ctx_part | blk_part[None]) & ~ctx_full
    return partial, ctx_full


def _to_indices(tile_map):
    """(b, nq, nk) bool -> counts (b, 1, nq) and key-tile indices (b, 1, nq, nk), hits first."""
    counts = tile_map.sum(-1, dtype=torch.int32)
    order = torch.argsort((~tile_map).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts[:, None], order[:, None]


def build_block_mask(anchors, context_len, block_size, doc_ids=None, sliding_window=None, causal_block=False):
    """A flex-attention BlockMask equal to `visible_mask` with the same arguments."""
    b, n = anchors.shape
    q_len = n * block_size

    def mask_mod(bi, _h, q, kv):
        blk, s = q // block_size, q % block_size
        anchor = anchors[bi, blk]
        is_ctx = kv < context_len
        ctx_idx = torch.clamp(kv, max=context_len - 1)
        see_ctx = kv < anchor
        if doc_ids is not None:
            see_ctx = see_ctx & (doc_ids[bi, ctx_idx] == doc_ids[bi, torch.clamp(anchor, max=context_len - 1)])
        kb = torch.clamp(kv - context_len, min=0)
        ks = kb % block_size
        see_blk = (kb // block_size == blk) & ((ks <= s) if causal_block else True)
        if sliding_window is not None:
            see_ctx = see_ctx & (anchor + s - kv < sliding_window)
            see_blk = see_blk & (s - ks < sliding_window)
        return torch.where(is_ctx, see_ctx, see_blk)

    exact_ctx = doc_ids is None and sliding_window is None
    partial, full = _tile_maps(anchors, context_len, block_size, exact_ctx)
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
    block_size = int(getattr(config, "block_size", 16))
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
