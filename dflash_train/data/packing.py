"""Packing several conversations into one training row, and the per-document bookkeeping.

A packed row is the concatenation of whole (already truncated) conversations. ``doc_ids``
(T,) numbers them 0, 1, ...; positions restart at 0 in each document so that RoPE sees
every conversation exactly as it would alone, and masks keep documents apart.
"""

from __future__ import annotations

import torch

# doc id of right padding in a collated batch: equal to no real document.
PAD_DOC = -1


def pack_by_length(lengths: list[int], max_length: int) -> list[list[int]]:
    """Group sample indices into rows of at most ``max_length`` tokens (next-fit, in order).

    Next-fit is O(n) and deterministic in the dataset order; with conversations much
    shorter than ``max_length`` it wastes little, and every sample lands in exactly one row.
    """
    rows: list[list[int]] = []
    used = max_length + 1  # forces a first row
    for index, length in enumerate(lengths):
        length = min(length, max_length)
        if used + length > max_length:
            rows.append([])
            used = 0
        rows[-1].append(index)
        used += length
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
