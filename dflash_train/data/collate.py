"""Batching training examples: right padding to the longest row and the most anchors.

Shapes: b rows, T longest row, N most anchors in a row, B block size, Q = N * B queries.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch.nn.utils.rnn import pad_sequence

from dflash_train.contract import IGNORE_INDEX
from dflash_train.data.packing import PAD_DOC


@dataclass
class Batch:
    input_ids: torch.Tensor  # (b, T) long, right padded
    attention_mask: torch.Tensor  # (b, T) long, 1 on real tokens
    position_ids: torch.Tensor  # (b, T) long, restarting per packed document
    doc_ids: torch.Tensor | None  # (b, T) long (PAD_DOC on padding) when rows are packed
    anchors: torch.Tensor  # (b, N) long, sorted; 0 on padding anchors
    anchor_valid: torch.Tensor  # (b, N) bool
    block_ids: torch.Tensor  # (b, Q) long: [x[p], MASK, ...] per block
    block_position_ids: torch.Tensor  # (b, Q) long
    labels: torch.Tensor  # (b, Q) long, IGNORE_INDEX where not supervised

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def to(self, device: torch.device | str) -> "Batch":
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return Batch(**{k: v if v is None else v.to(device, non_blocking=True) for k, v in moved.items()})


def _pad(tensors: list[torch.Tensor], value: int) -> torch.Tensor:
    return pad_sequence(tensors, batch_first=True, padding_value=value)


def collate(examples: list[dict], mask_token_id: int, pad_token_id: int = 0) -> Batch:
    """Stack per-row examples (see ``dataset.build_example``) into one padded Batch.

    A row with fewer anchors than the widest row gets padding blocks: their anchors are
    marked invalid (the mask builder hides them) and their labels are all ignored.
    """
    if not examples:
        raise ValueError("cannot collate an empty list of examples")
    n_max = max(1, max(e["anchors"].numel() for e in examples))
    anchors = torch.zeros(len(examples), n_max, dtype=torch.long)
    valid = torch.zeros(len(examples), n_max, dtype=torch.bool)
    for i, e in enumerate(examples):
        anchors[i, : e["anchors"].numel()] = e["anchors"]
        valid[i, : e["anchors"].numel()] = True
    packed = examples[0]["doc_ids"] is not None
    return Batch(
        input_ids=_pad([e["input_ids"] for e in examples], pad_token_id),
        attention_mask=_pad([torch.ones_like(e["input_ids"]) for e in examples], 0),
        position_ids=_pad([e["position_ids"] for e in examples], 0),
        doc_ids=_pad([e["doc_ids"] for e in examples], PAD_DOC) if packed else None,
        anchors=anchors,
        anchor_valid=valid,
        block_ids=_pad_blocks([e["block_ids"] for e in examples], n_max, mask_token_id),
        block_position_ids=_pad_blocks([e["block_position_ids"] for e in examples], n_max, 0),
        labels=_pad_blocks([e["labels"] for e in examples], n_max, IGNORE_INDEX),
    )


def _pad_blocks(blocks: list[torch.Tensor], n_max: int, value: int) -> torch.Tensor:
    """list of (N_i, B) -> (b, n_max * B): padding blocks appended after the real ones."""
    block_size = blocks[0].shape[-1]
    out = torch.full((len(blocks), n_max, block_size), value, dtype=torch.long)
    for i, blk in enumerate(blocks):
        out[i, : blk.shape[0]] = blk
    return out.flatten(1)
