"""Batching training examples: right padding to the longest row and the most anchors, or to a
fixed shape (every step the same shapes, so a compiled drafter never recompiles).

Shapes: b rows, T tokens per row, N blocks per row, B block size, Q = N * B queries,
M supervised slots of the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch.nn.utils.rnn import pad_sequence

from dflash_train.contract import IGNORE_INDEX
from dflash_train.data.packing import PAD_DOC


@dataclass
class BatchStats:
    """What a batch really holds (padding excluded), counted on the host when it is built, so
    that metrics and FLOP counts never wait for the device."""

    rows: int
    conversations: int
    tokens: int
    blocks: int  # valid anchors
    supervised: int  # M
    context_sum: int  # sum over valid anchors of their position in their conversation
    attention_pairs: int  # sum over conversations of length^2 (causal target attention)


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
    supervised_index: torch.Tensor  # (M,) long: flat indices into (b * Q) of the supervised slots
    stats: BatchStats
    # The data rows (TrainingData indices) of the batch's real rows, in order, and their
    # token counts; empty when the batch was not built from indexed rows.
    data_rows: tuple[int, ...] = ()
    row_tokens: tuple[int, ...] = ()

    def _tensors(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _HOST_FIELDS}

    def _host(self) -> dict:
        return {name: getattr(self, name) for name in _HOST_FIELDS}

    def to(self, device: torch.device | str) -> "Batch":
        moved = {k: v if v is None else v.to(device, non_blocking=True) for k, v in self._tensors().items()}
        return Batch(**moved, **self._host())

    def pin_memory(self) -> "Batch":
        """Page-locked host copies: the copy to the GPU then overlaps with its work."""
        pinned = {k: v if v is None else v.pin_memory() for k, v in self._tensors().items()}
        return Batch(**pinned, **self._host())


_HOST_FIELDS = ("stats", "data_rows", "row_tokens")


def _pad(tensors: list[torch.Tensor], value: int, length: int | None) -> torch.Tensor:
    out = pad_sequence(tensors, batch_first=True, padding_value=value)
    if length is not None and out.shape[1] < length:
        out = torch.nn.functional.pad(out, (0, length - out.shape[1]), value=value)
    return out


def collate(examples: list[dict], mask_token_id: int, pad_token_id: int = 0,
            shape: tuple[int, int] | None = None, rows: int | None = None,
            data_rows: list[int] | None = None) -> Batch:
    """Stack per-row examples (see ``dataset.build_example``) into one padded Batch.

    A row with fewer anchors than the widest row gets padding blocks: their anchors are
    marked invalid (the mask builder hides them) and their labels are all ignored.
    ``shape`` (T, N) pads every row to exactly T tokens and N blocks; ``rows`` appends
    all-padding rows up to that many (whose labels are all ignored). ``data_rows``: the data
    row each example came from, kept on the batch (the trainer's feature cache keys).
    """
    if not examples:
        raise ValueError("cannot collate an empty list of examples")
    if data_rows is not None and len(data_rows) != len(examples):
        raise ValueError(f"{len(data_rows)} data rows for {len(examples)} examples")
    length, n_fixed = shape if shape is not None else (None, None)
    longest = max(e["input_ids"].numel() for e in examples)
    widest = max(1, max(e["anchors"].numel() for e in examples))
    if shape is not None and (longest > length or widest > n_fixed):
        raise ValueError(f"a row of {longest} tokens / {widest} blocks does not fit the fixed shape {shape}")
    n_max = n_fixed or widest
    real = len(examples)
    # Filler rows (to reach ``rows``): one pad token that attends to itself, no anchors. A row
    # with every key masked would give NaN target features, and NaN times a zero attention
    # weight is still NaN.
    filler = {"input_ids": torch.full((1,), pad_token_id), "position_ids": torch.zeros(1, dtype=torch.long),
              "doc_ids": None if examples[0]["doc_ids"] is None else torch.full((1,), PAD_DOC)}
    rows_ = examples + [filler] * max(0, (rows or 0) - real)
    anchors = torch.zeros(len(rows_), n_max, dtype=torch.long)
    valid = torch.zeros(len(rows_), n_max, dtype=torch.bool)
    for i, e in enumerate(examples):
        anchors[i, : e["anchors"].numel()] = e["anchors"]
        valid[i, : e["anchors"].numel()] = True
    packed = examples[0]["doc_ids"] is not None
    labels = _pad_blocks([e["labels"] for e in examples], n_max, IGNORE_INDEX, len(rows_))
    return Batch(
        input_ids=_pad([e["input_ids"] for e in rows_], pad_token_id, length),
        attention_mask=_pad([torch.ones_like(e["input_ids"]) for e in rows_], 0, length),
        position_ids=_pad([e["position_ids"] for e in rows_], 0, length),
        doc_ids=_pad([e["doc_ids"] for e in rows_], PAD_DOC, length) if packed else None,
        anchors=anchors,
        anchor_valid=valid,
        block_ids=_pad_blocks([e["block_ids"] for e in examples], n_max, mask_token_id, len(rows_)),
        block_position_ids=_pad_blocks([e["block_position_ids"] for e in examples], n_max, 0, len(rows_)),
        labels=labels,
        supervised_index=torch.nonzero(labels.flatten() != IGNORE_INDEX).flatten(),
        stats=_stats(examples),
        data_rows=tuple(data_rows or ()),
        row_tokens=tuple(e["input_ids"].numel() for e in examples) if data_rows else (),
    )


def _stats(examples: list[dict]) -> BatchStats:
    conversations = tokens = blocks = supervised = context = pairs = 0
    for e in examples:
        n = e["input_ids"].numel()
        doc_lengths = [n] if e["doc_ids"] is None else torch.bincount(e["doc_ids"]).tolist()
        conversations += len(doc_lengths)
        tokens += n
        pairs += sum(d * d for d in doc_lengths)
        blocks += e["anchors"].numel()
        supervised += int((e["labels"] != IGNORE_INDEX).sum())
        context += int(e["position_ids"][e["anchors"]].sum())
    return BatchStats(rows=len(examples), conversations=conversations, tokens=tokens, blocks=blocks,
                      supervised=supervised, context_sum=context, attention_pairs=pairs)


def _pad_blocks(blocks: list[torch.Tensor], n_max: int, value: int, rows: int) -> torch.Tensor:
    """list of (N_i, B) -> (rows, n_max * B): padding blocks appended after the real ones."""
    block_size = blocks[0].shape[-1]
    out = torch.full((rows, n_max, block_size), value, dtype=torch.long)
    for i, blk in enumerate(blocks):
        out[i, : blk.shape[0]] = blk
    return out.flatten(1)
