"""The training data: a dflash-datagen directory turned into per-step batches of examples.

Order and anchors depend only on (seed, epoch, row index), and each optimizer step owns a
fixed slice of the epoch's order (the global batch); a process reads a disjoint part of
that slice. So a run on 1 process and one on 2 with the same global batch see the same
samples per step, and a resumed run continues with exactly the batches it would have seen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_train import contract
from dflash_train.data.packing import document_ids, document_positions, pack_by_length


def row_lengths(ds) -> list[int]:
    """Token count of every row, read from the Arrow column without decoding the rows."""
    import pyarrow.compute as pc

    return pc.list_value_length(ds.data.column("input_ids")).to_pylist()


def build_example(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    doc_ids: torch.Tensor | None,
    *,
    seed: int,
    num_anchors: int,
    block_size: int,
    mask_token_id: int,
) -> dict:
    """One row's tensors for ``collate``: the contract's anchors, block inputs and labels."""
    position_ids = torch.arange(input_ids.numel()) if doc_ids is None else document_positions(doc_ids)
    anchors = contract.sample_anchors(contract.anchor_candidates(loss_mask, doc_ids), num_anchors, seed)  # (N,)
    return {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "doc_ids": doc_ids,
        "anchors": anchors,
        "block_ids": contract.block_input_ids(input_ids, anchors, block_size, mask_token_id),  # (N, B)
        "block_position_ids": contract.block_position_ids(position_ids, anchors, block_size),  # (N, B)
        "labels": contract.block_labels(input_ids, loss_mask, anchors, block_size, doc_ids),  # (N, B)
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
    """Rows (single conversations, or packed groups of them) and their per-epoch examples."""

    def __init__(self, ds, *, max_length: int, packing: bool, seed: int, shuffle: bool,
                 num_anchors: int, block_size: int, mask_token_id: int, indices: list[int] | None = None):
        """``indices``: the dataset rows to use (a training or validation split); all by default."""
        self.indices = list(range(len(ds))) if indices is None else list(indices)
        if not self.indices:
            raise ValueError("the training dataset is empty")
        self.ds = ds
        self.seed, self.shuffle, self.packing = seed, shuffle, packing
        self.max_length = max_length
        self.example_kwargs = dict(num_anchors=num_anchors, block_size=block_size, mask_token_id=mask_token_id)
        all_lengths = row_lengths(ds)
        lengths = [all_lengths[i] for i in self.indices]
        self.num_truncated = sum(n > max_length for n in lengths)
        # Packing is fixed once from the dataset order, so a row id names the same
        # conversations in every epoch and after a resume; epochs shuffle whole rows.
        self.groups = pack_by_length(lengths, max_length) if packing else [[i] for i in range(len(lengths))]

    def __len__(self) -> int:
        return len(self.groups)

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

    def example(self, row: int, epoch: int) -> dict:
        parts = [self._conversation(i) for i in self.groups[row]]
        ids = torch.cat([p[0] for p in parts])
        mask = torch.cat([p[1] for p in parts])
        docs = document_ids([p[0].numel() for p in parts]) if self.packing else None
        seed = contract.anchor_seed(self.seed, epoch, row)
        return build_example(ids, mask, docs, seed=seed, **self.example_kwargs)
