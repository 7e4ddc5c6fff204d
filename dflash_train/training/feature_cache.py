"""The frozen target's features of each training row, kept after the row's first forward.

The target is frozen and a row holds the same tokens every epoch (only its anchors are drawn
afresh), so its features are the same every epoch too: from the second epoch on, a step that
reads them here skips the target's forward (22-38% of a quickstart step, by CPU). The cost
is memory: every training row's features, trimmed to its real tokens, in the dtype the
drafter reads, on the training device (``bytes_needed`` says how much).
"""

from __future__ import annotations

import torch

from dflash_train.data.collate import Batch


class FeatureCache:
    """Data row -> the features of that row alone (T_row, F); ``get`` rebuilds a batch's padded
    (b, T, F) features only when every one of its rows is kept, else the step runs the target."""

    def __init__(self) -> None:
        self._rows: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, batch: Batch) -> torch.Tensor | None:
        rows = batch.data_rows
        if not rows or any(r not in self._rows for r in rows):
            return None
        first = self._rows[rows[0]]
        b, length = batch.input_ids.shape
        # Padding and filler rows get zeros: no real query attends to a position past its
        # row's tokens, and a filler row supervises nothing.
        out = first.new_zeros(b, length, first.shape[-1])
        for i, r in enumerate(rows):
            kept = self._rows[r]
            out[i, : kept.shape[0]] = kept
        return out

    def put(self, batch: Batch, feats: torch.Tensor) -> None:
        """Keep the rows of ``feats`` (b, T, F), the target's features of ``batch``."""
        for i, (r, tokens) in enumerate(zip(batch.data_rows, batch.row_tokens)):
            if r not in self._rows:
                self._rows[r] = feats[i, :tokens].clone()


def bytes_needed(tokens: int, num_features: int, dtype: torch.dtype) -> int:
    """Memory of the features of ``tokens`` training tokens once all are kept."""
    return tokens * num_features * torch.empty((), dtype=dtype).element_size()
