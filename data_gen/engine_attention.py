"""The generation engine's decode attention (data_gen/engine.py): each slot's one new query
token attends over its own cache row, by `backend.attention`:

  * sdpa: scaled_dot_product_attention over the first `width` cache columns of EVERY row
    (`width` covers the longest busy row) under a boolean mask per row: a row reads `width`
    columns whatever it holds, a finished row too;
  * flex: flex_attention (compiled) under a BlockMask built from each row's position: a row
    reads only the DECODE_BLOCK-column blocks that hold its visible keys, ceil((pos + 1) /
    DECODE_BLOCK) of them under full attention, those its window touches under a sliding
    one, and a finished row none (its output is zero and goes nowhere). The mask is plain
    tensor ops on the device, so it is built inside the captured decode step without a host
    sync; on CUDA a query this short takes flex's decoding kernel.

Both fold grouped-query attention the same way: the G query heads of one KV head are that
head's G queries, (B, Hkv, G, D), so each KV head is read once for all of them and the cache
is never repeated. (flex's own enable_gqa does this in its decoding kernel only when G is a
power of 2, and Qwen2.5-0.5B has G = 7.)

Shapes: B slots, Hkv KV heads, G query heads per KV head, D head dim, S cache columns.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention
# KV columns per block of the flex BlockMask: a row reads its blocks whole, so on average
# half a block more than it holds. flex's decoding kernel tiles a block by up to 64 columns.
DECODE_BLOCK = 128
# flex's decoding kernel options on CUDA (BLOCK_N, SPLIT_KV, num_warps, num_stages; CPU takes
# inductor's defaults). `python -m benchmarks.flex_decode_sweep` times candidates on issue 39's
# shapes: on an H200 (2026-11-28, benchmarks/quality-arms/README.md) two programs a row and head
# and three pipeline stages took a step's 24 layers from 1.70 ms (inductor's defaults) to 1.21 ms,
# reading the cache at 3.1 TB/s instead of 2.2, as close to SDPA as the defaults.
DECODE_KERNEL_OPTIONS: dict = {"SPLIT_KV": 2, "num_stages": 3}


def visible(pos: torch.Tensor, width: int, window: int | None) -> torch.Tensor:
    """(B, width) bool: the cache columns row b attends to (its keys at positions <= pos[b],
    and within the sliding window, when there is one)."""
    cols = torch.arange(width, device=pos.device)
    seen = cols[None, :] <= pos[:, None]
    if window is not None:
        seen &= cols[None, :] > pos[:, None] - window
    return seen


def kv_blocks(pos: torch.Tensor, live: torch.Tensor, length: int, window: int | None,
              block: int = DECODE_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks read (B,), block indices (B, ceil(length / block))): row b reads the
    `count[b]` blocks from its first visible column's block to its own position's, in order;
    a finished row (live False) reads none. Indices past a row's count repeat the last block
    of the row (they are never read, but must be valid)."""
    total = -(-length // block)
    first = torch.zeros_like(pos) if window is None else (pos - window + 1).clamp(min=0)
    first_block = first // block
    count = torch.where(live, pos // block - first_block + 1, 0)
    indices = (first_block[:, None] + torch.arange(total, device=pos.device)).clamp(max=total - 1)
    return count, indices


def block_mask(pos: torch.Tensor, live: torch.Tensor, length: int, groups: int, window: int | None,
               block: int = DECODE_BLOCK) -> BlockMask:
    """The flex BlockMask of one decode step over `length` cache columns, `groups` query
    rows (the folded query heads) per KV head, `block` columns a block; within a block,
    mask_mod cuts the columns the row does not see."""
    count, indices = kv_blocks(pos, live, length, window, block)

    def mask_mod(b, h, q, kv):
        seen = kv <= pos[b]
        if window is not None:
            seen = seen & (kv > pos[b] - window)
        return seen

    # compute_q_blocks=False: the transposed (query-side) indices serve the backward only.
    return BlockMask.from_kv_blocks(count.int()[:, None, None], indices.int()[:, None, None], BLOCK_SIZE=block,
                                    mask_mod=mask_mod, seq_lengths=(groups, length), compute_q_blocks=False)


@functools.cache
def compiled_flex():
    """flex_attention compiled once per process. Each shape and window compiles on first use
    (an engine has one shape); past dynamo's recompile_limit (8) in one process, flex would run
    unfused: right, but reading everything, as it would after a graph break (hence fullgraph)."""
    return torch.compile(flex_attention, dynamic=False, fullgraph=True)


def packed_bounds(starts: torch.Tensor, sequences: int) -> torch.Tensor:
    """(sequences + 1,) int32: where each prompt of a packed row begins, then the row's length
    (flash attention's cumulative sequence lengths), from `starts` (T,), where each token's
    prompt starts (the padding after the prompts a prompt of its own). A row of fewer prompts
    ends in empty ones (the bound repeated): the shape is the same for every row, so a captured
    forward serves any number of prompts. Plain tensor ops, no host sync."""
    first = starts == torch.arange(len(starts), device=starts.device)  # a prompt's first token
    return sequence_bounds(first.cumsum(0) - 1, sequences)  # each token's prompt, 0, 1, ... in order


def packed_mask(starts: torch.Tensor, window: int | None) -> torch.Tensor:
    """(T, T) bool: query t sees the keys of its own prompt up to itself (within `window`)."""
    t = torch.arange(len(starts), device=starts.device)
    return sequence_mask(starts, starts, t, t, window)


def sequence_mask(q_seq: torch.Tensor, k_seq: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                  window: int | None) -> torch.Tensor:
    """(T, Tk) bool, the dense mask of packed rows: query t sees the keys of its own sequence
    (`q_seq`, `k_seq`) at positions up to its own (`q_pos`, `k_pos`), within `window`."""
    seen = (q_seq[:, None] == k_seq[None, :]) & (k_pos[None, :] <= q_pos[:, None])
    return seen & (k_pos[None, :] > q_pos[:, None] - window) if window is not None else seen


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor, bounds: torch.Tensor,
                     longest: int, window: int | None, scale: float | None, masks: dict) -> torch.Tensor:
    """q (1, Hq, T, D), k/v (1, Hkv, T, D) of a packed prefill: several prompts in one row, each
    attending to itself alone (`starts` (T,) and `bounds` (packed_bounds) say where they are, no
    prompt or padding longer than `longest`); returns (1, Hq, T, D). In half precision on a GPU
    flash attention's variable-length kernel (causal within each prompt, grouped-query heads as
    they are, padding-free but the row's end); otherwise SDPA under the dense (T, T) mask
    (packed_mask, built once a forward: `masks` by window), which only short rows can afford
    (data_gen/engine.py PACKED_DENSE_TOKENS)."""
    if packed_flash(q):
        left = {} if window is None else {"window_size_left": window - 1, "window_size_right": 0}
        out = torch.ops.aten._flash_attention_forward(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                                                      bounds, bounds, longest, longest, 0.0, True, False, scale=scale,
                                                      **left)[0]  # (T, Hq, D)
        return out.transpose(0, 1)[None]
    mask = masks.get(window)
    if mask is None:
        mask = masks[window] = packed_mask(starts, window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def sequence_bounds(seq: torch.Tensor, sequences: int) -> torch.Tensor:
    """(sequences + 1,) int32: where each sequence of a packed row begins, then the row's
    length, from `seq` (T,), each token's sequence (0, 1, ... in order): packed_bounds's, for
    rows whose sequences are numbered."""
    return torch.searchsorted(seq, torch.arange(sequences + 1, device=seq.device)).int()


def packed_kept_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_seq: torch.Tensor,
                          k_seq: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, bounds: tuple,
                          window: int | None, scale: float | None, masks: dict) -> torch.Tensor:
    """The next turns of several conversations in one row: q (1, Hq, T, D) their new tokens, k/v
    (Tk, Hkv, D) each conversation's cache entries up to its last new token, gathered in the
    same order; `q_seq`/`k_seq` each token's and key's conversation (0, 1, ... in order),
    `bounds` their sequence_bounds and what no conversation's new tokens exceed, `q_pos`/`k_pos`
    their positions. Query t sees the keys of its own conversation at positions up to its own
    (within `window`); returns (1, Hq, T, D). Flash
    attention's variable-length kernel in half precision on a GPU (causal from the bottom right:
    a conversation's last query sees its last key, as its keys end at its last new token), SDPA
    under the dense mask of those pairs otherwise (built once a forward: `masks` by window)."""
    if packed_flash(q):
        left = {} if window is None else {"window_size_left": window - 1, "window_size_right": 0}
        q_bounds, k_bounds, longest = bounds
        out = torch.ops.aten._flash_attention_forward(q[0].transpose(0, 1), k, v, q_bounds, k_bounds, longest,
                                                      k.shape[0], 0.0, True, False, scale=scale, **left)[0]
        return out.transpose(0, 1)[None]
    mask = masks.get(window)
    if mask is None:
        mask = masks[window] = sequence_mask(q_seq, k_seq, q_pos, k_pos, window)
    return F.scaled_dot_product_attention(q, k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
                                          scale=scale, enable_gqa=True)


def packed_flash(x: torch.Tensor) -> bool:
    """Whether a packed prefill of tensors like x takes flash attention (packed_attention)."""
    return x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)


def decode_attention(kind: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                     live: torch.Tensor, width: int, window: int | None, scale: float | None,
                     masks: dict) -> torch.Tensor:
    """q (B, Hkv, G, D) folded queries, k/v (B, Hkv, S, D) the layer's cache with this step's
    keys written; returns (B, Hkv, G, D). `masks` holds the step's masks by window, shared by
    every layer: the engine builds flex's before the layers (GenerationEngine._logits, so a
    layer compiled alone reads it as an input); one missing is built by the first layer."""
    if kind == "flex":
        mask = masks.get(window)
        if mask is None:
            mask = masks[window] = block_mask(pos, live, k.shape[2], q.shape[2], window)
        # traced inside a compiled step, flex_attention itself (the cached wrapper would be inlined
        # with a warning); eager, compiled once a process
        flex = flex_attention if torch.compiler.is_compiling() else compiled_flex()
        return flex(q, k, v, block_mask=mask, scale=scale, kernel_options=DECODE_KERNEL_OPTIONS if q.is_cuda else None)
    mask = masks.get(window)
    if mask is None:
        mask = masks[window] = visible(pos, width, window)[:, None, None, :]  # (B, 1, 1, width)
    return F.scaled_dot_product_attention(q, k[:, :, :width], v[:, :, :width], attn_mask=mask, scale=scale)
