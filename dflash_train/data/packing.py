"""Packing several conversations into one training row, and the per-document bookkeeping.

A packed row is the concatenation of whole (already truncated) conversations. ``doc_ids``
(T,) numbers them 0, 1, ...; positions restart at 0 in each document so that RoPE sees
every conversation exactly as it would alone, and masks keep documents apart.
"""

from __future__ import annotations

import numpy as np
import torch

# doc id of right padding in a collated batch: equal to no real document.
PAD_DOC = -1


def pack_rows(lengths: list[int], max_length: int, blocks: list[int] | None = None,
              max_blocks: int | None = None, open_rows: int = 16) -> list[list[int]]:
    """Group sample indices into rows of at most ``max_length`` tokens and, when ``blocks``
    is given, at most ``max_blocks`` anchor blocks (first fit over the last ``open_rows``
    rows, in dataset order).

    Deterministic in the dataset order, and every sample lands in exactly one row, its
    samples in ascending order. Keeping a few rows open fills them far better than next-fit
    (which closes a row at the first sample that does not fit): a fixed-shape row's unused
    tokens and blocks are computed anyway, so fill is speed. Lengths are capped at
    ``max_length`` (the dataset truncates longer samples).
    """
    if blocks is not None and max_blocks is not None:
        too_many = [(i, a) for i, a in enumerate(blocks) if a > max_blocks]
        if too_many:
            raise ValueError(f"sample {too_many[0][0]} has {too_many[0][1]} anchor blocks > a row's "
                             f"budget of {max_blocks}")
    tok_cap = max_length
    blk_cap = max_blocks if blocks is not None and max_blocks is not None else None
    rows: list[list[int]] = []
    # Open rows: their index in ``rows`` and their free tokens / blocks, oldest first.
    open_ids = np.zeros(0, dtype=np.int64)
    free_tok = np.zeros(0, dtype=np.int64)
    free_blk = np.zeros(0, dtype=np.int64)
    for index, length in enumerate(lengths):
        n = min(length, tok_cap)
        a = blocks[index] if blk_cap is not None else 0
        fits = (free_tok >= n) & (free_blk >= a)
        if fits.any():
            slot = int(fits.argmax())
        else:
            if len(open_ids) == open_rows:  # close the oldest row
                open_ids, free_tok, free_blk = open_ids[1:], free_tok[1:], free_blk[1:]
            rows.append([])
            open_ids = np.append(open_ids, len(rows) - 1)
            free_tok = np.append(free_tok, tok_cap)
            free_blk = np.append(free_blk, blk_cap if blk_cap is not None else 0)
            slot = len(open_ids) - 1
        rows[int(open_ids[slot])].append(index)
        free_tok[slot] -= n
        free_blk[slot] -= a
    return rows


def document_ids(lengths: list[int]) -> torch.Tensor:
    """(sum(lengths),) long: document number of each token of a packed row."""
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """(T,) position of each token inside its own document (0 at every document start)."""
    T = doc_ids.numel()
    idx = torch.arange(T)
    starts = torch.ones(T, dtype=torch.bool)
    starts[1:] = doc_ids[1:] != doc_ids[:-1]
    start_of = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=0).values
    return idx - start_of


def document_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """(b, 1, T, T) bool, True where query i may attend key j: j <= i in the same document.

    Padding (PAD_DOC) attends to itself only, which keeps its softmax rows finite; its
    outputs are never read.
    """
    T = doc_ids.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    same = doc_ids[:, :, None] == doc_ids[:, None, :]  # (b, T, T)
    return (causal & same)[:, None]
