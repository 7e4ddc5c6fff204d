"""The training data: a dflash-datagen directory turned into per-step batches of examples.

Order and anchors depend only on (seed, epoch, row index), and each optimizer step owns a
fixed slice of the epoch's order (the global batch); a process reads a disjoint part of
that slice. So a run on 1 process and one on 2 with the same global batch see the same
samples per step, and a resumed run continues with exactly the batches it would have seen.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dflash_train import contract
from dflash_train.data.packing import document_ids, document_positions, pack_rows


def row_lengths(ds) -> list[int]:
    """Token count of every row, read from the Arrow column without decoding the rows."""
    import pyarrow.compute as pc

    return pc.list_value_length(ds.data.column("input_ids")).to_pylist()


def anchor_counts(ds, max_length: int, num_anchors: int, rows_per_pass: int = 16384,
                  kind: str = contract.DFLASH) -> np.ndarray:
    """(rows,) how many anchors each conversation gets: min(candidates, num_anchors), where the
    candidates of a conversation truncated to L = min(len, max_length) tokens are the p < L - 1
    with loss_mask[p + 1] == 1, and for dspark also loss_mask[p] == 1 (``contract.anchor_candidates``).

    Read from the Arrow column a slice at a time (a paper-sized dataset holds a billion mask
    values), without decoding rows: packing needs every count before the first step.
    """
    column = ds.data.column("loss_mask")
    out = []
    for chunk in column.chunks:
        for start in range(0, len(chunk), rows_per_pass):
            part = chunk.slice(start, rows_per_pass)
            offsets = part.offsets.to_numpy().astype(np.int64)  # (rows + 1,) absolute
            first = offsets[:-1] - offsets[0]  # (rows,) start of each row in the slice's values
            values = part.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
            if kind == contract.DSPARK:
                # value j becomes mask[j - 1] * mask[j]: "p = j - 1 is a candidate" for j >= 1 of a row;
                # a row's own first value is never counted below, so the product across rows is harmless.
                values = values * np.concatenate([[0], values[:-1]])
            csum = np.concatenate([[0], np.cumsum(values)])  # csum[j] = sum of values[:j]
            length = np.minimum(offsets[1:] - offsets[:-1], max_length)
            # candidates p + 1 run over positions 1 .. L-1 of each conversation (none when L <= 1)
            count = csum[first + length] - csum[first + np.minimum(length, 1)]
            out.append(np.minimum(count, num_anchors))
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def build_example(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    doc_ids: torch.Tensor | None,
    anchors: torch.Tensor,
    *,
    block_size: int,
    mask_token_id: int,
    kind: str = contract.DFLASH,
) -> dict:
    """One row's tensors for ``collate``: block inputs and labels of the given sorted anchors
    (labels by the drafter ``kind``'s slot convention)."""
    labels = contract.dspark_block_labels if kind == contract.DSPARK else contract.block_labels
    position_ids = torch.arange(input_ids.numel()) if doc_ids is None else document_positions(doc_ids)
    return {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "doc_ids": doc_ids,
        "anchors": anchors,
        "block_ids": contract.block_input_ids(input_ids, anchors, block_size, mask_token_id),  # (N, B)
        "block_position_ids": contract.block_position_ids(position_ids, anchors, block_size),  # (N, B)
        "labels": labels(input_ids, loss_mask, anchors, block_size, doc_ids),  # (N, B)
    }


@dataclass
class StepSlice:
    """Where a process's micro-batches sit inside each global batch."""

    micro_batch_size: int
    grad_accum_steps: int
    world_size: int
    rank: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps * self.world_size

    def rows(self, order: torch.Tensor, step_in_epoch: int, micro: int) -> list[int]:
        """Row ids of micro-batch ``micro`` of this rank: micro-major, then rank."""
        start = step_in_epoch * self.global_batch + (micro * self.world_size + self.rank) * self.micro_batch_size
        return order[start : start + self.micro_batch_size].tolist()


class TrainingData:
    """Rows (single conversations, or packed groups of them) and their per-epoch examples.

    Anchors are drawn per conversation, with the conversation's own seed and the per-sequence
    cap ``num_anchors``: a conversation gets the same anchors whether it is packed or alone,
    so short conversations are never starved by a row-wide cap.

    ``blocks_per_row`` fixes the shapes: every row is padded to exactly ``max_length`` tokens
    and ``blocks_per_row`` blocks (packing then also budgets blocks per row), so a compiled
    drafter sees one shape for the whole run. None: rows keep their natural length and
    ``collate`` pads to the widest row of a batch.
    """

    def __init__(self, ds, *, max_length: int, packing: bool, seed: int, shuffle: bool,
                 num_anchors: int, block_size: int, mask_token_id: int, indices: list[int] | None = None,
                 blocks_per_row: int | None = None, kind: str = contract.DFLASH):
        """``indices``: the dataset rows to use (a training or validation split); all by default.
        ``kind``: the drafter kind, whose anchor and label rules the examples follow."""
        self.indices = list(range(len(ds))) if indices is None else list(indices)
        if not self.indices:
            raise ValueError("the training dataset is empty")
        if blocks_per_row is not None and blocks_per_row < num_anchors:
            raise ValueError(f"data.blocks_per_row={blocks_per_row} is below data.num_anchors={num_anchors}: "
                             "a single conversation could not fit a row")
        self.ds = ds
        self.seed, self.shuffle, self.packing = seed, shuffle, packing
        self.max_length = max_length
        self.num_anchors, self.block_size, self.mask_token_id = num_anchors, block_size, mask_token_id
        self.blocks_per_row = blocks_per_row
        self.kind = contract.check_kind(kind)
        all_lengths = row_lengths(ds)
        lengths = [all_lengths[i] for i in self.indices]
        self.num_truncated = sum(n > max_length for n in lengths)
        self.num_tokens = sum(min(n, max_length) for n in lengths)  # of every row, after truncation
        # Packing is fixed once from the dataset order, so a row id names the same
        # conversations in every epoch and after a resume; epochs shuffle whole rows.
        if packing:
            blocks = None
            if blocks_per_row is not None:
                counts = anchor_counts(ds, max_length, num_anchors, kind=kind)
                blocks = [int(counts[i]) for i in self.indices]
            self.groups = pack_rows(lengths, max_length, blocks, blocks_per_row)
        else:
            self.groups = [[i] for i in range(len(lengths))]

    def __len__(self) -> int:
        return len(self.groups)

    @property
    def fixed_shape(self) -> tuple[int, int] | None:
        """(tokens, blocks) every collated row is padded to, or None for natural shapes."""
        return None if self.blocks_per_row is None else (self.max_length, self.blocks_per_row)

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """(rows,) the row ids in the order epoch ``epoch`` visits them."""
        if not self.shuffle:
            return torch.arange(len(self))
        gen = torch.Generator().manual_seed(contract.derive_seed("shuffle", self.seed, epoch))
        return torch.randperm(len(self), generator=gen)

    def _conversation(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.ds[self.indices[index]]
        ids = contract.truncate(torch.tensor(row["input_ids"], dtype=torch.long), self.max_length)
        mask = contract.truncate(torch.tensor(row["loss_mask"], dtype=torch.long), self.max_length)
        return ids, mask

    def _anchors(self, index: int, loss_mask: torch.Tensor, epoch: int) -> torch.Tensor:
        """Conversation ``index``'s sorted anchors in ``epoch``, as positions in the conversation."""
        seed = contract.anchor_seed(self.seed, epoch, index)
        return contract.sample_anchors(contract.anchor_candidates(loss_mask, kind=self.kind), self.num_anchors, seed)

    def example(self, row: int, epoch: int) -> dict:
        parts = [self._conversation(i) for i in self.groups[row]]
        ids = torch.cat([p[0] for p in parts])
        mask = torch.cat([p[1] for p in parts])
        docs = document_ids([p[0].numel() for p in parts]) if self.packing else None
        anchors, offset = [], 0
        for i, (conv_ids, conv_mask) in zip(self.groups[row], parts):
            anchors.append(self._anchors(i, conv_mask, epoch) + offset)
            offset += conv_ids.numel()
        return build_example(ids, mask, docs, torch.cat(anchors), block_size=self.block_size,
                             mask_token_id=self.mask_token_id, kind=self.kind)
