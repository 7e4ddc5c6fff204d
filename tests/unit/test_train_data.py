"""Data path: packing bookkeeping, per-rank slices of the global batch, per-epoch anchors, collate."""

import datasets
import pytest
import torch

from dflash_train.contract import IGNORE_INDEX
from dflash_train.data.collate import collate
from dflash_train.data.dataset import StepSlice, TrainingData
from dflash_train.data.packing import (
    PAD_DOC,
    document_causal_mask,
    document_ids,
    document_positions,
    pack_rows,
)

MASK = 7


def _rows(lengths):
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(10, 90, (n,), generator=g).tolist() for n in lengths]
    masks = [[0] * (n // 2) + [1] * (n - n // 2) for n in lengths]
    return datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": masks})


def _data(lengths=(20, 30, 12, 40, 25, 18), **kw):
    args = dict(max_length=32, packing=False, seed=0, shuffle=True, num_anchors=4, block_size=4, mask_token_id=MASK)
    args.update(kw)
    return TrainingData(_rows(lengths), **args)


def test_pack_rows_places_every_sample_once_within_budgets():
    assert pack_rows([5, 4, 3, 9, 2, 20], 10, open_rows=1) == [[0, 1], [2], [3], [4], [5]]  # next-fit
    # Rows stay open: 2 goes back beside 3 (next-fit would have closed that row), 1 beside 5 + 4.
    assert pack_rows([5, 4, 3, 9, 2, 20], 10) == [[0, 1], [2, 4], [3], [5]]
    assert pack_rows([5, 4, 3, 9, 1, 20], 10) == [[0, 1, 4], [2], [3], [5]]
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 40, (300,), generator=g).tolist()
    blocks = [min(n // 2, 8) for n in lengths]
    rows = pack_rows(lengths, 64, blocks, 24)
    assert sorted(i for r in rows for i in r) == list(range(300))
    assert all(r == sorted(r) for r in rows)
    assert all(sum(min(lengths[i], 64) for i in r) <= 64 and sum(blocks[i] for i in r) <= 24 for r in rows)
    assert len(rows) < len(pack_rows(lengths, 64, blocks, 24, open_rows=1))  # fuller than next-fit


def test_pack_rows_refuses_a_sample_over_the_block_budget():
    with pytest.raises(ValueError, match="sample 1 has 30 anchor blocks > a row's budget of 24"):
        pack_rows([10, 50], 64, [3, 30], 24)


def test_document_positions_and_mask():
    docs = document_ids([2, 3])
    assert docs.tolist() == [0, 0, 1, 1, 1]
    assert document_positions(docs).tolist() == [0, 1, 0, 1, 2]
    padded = torch.tensor([[0, 0, 1, PAD_DOC]])
    m = document_causal_mask(padded)[0, 0]
    assert m.tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [False, False, True, False],
        [False, False, False, True],
    ]


def test_one_process_and_two_see_the_same_samples_per_step():
    order = torch.randperm(24, generator=torch.Generator().manual_seed(1))
    one = StepSlice(micro_batch_size=2, grad_accum_steps=2, world_size=1, rank=0)
    two = [StepSlice(micro_batch_size=2, grad_accum_steps=1, world_size=2, rank=r) for r in (0, 1)]
    for step in range(3):
        single = [i for m in range(2) for i in one.rows(order, step, m)]
        split = [i for s in two for i in s.rows(order, step, 0)]
        assert single == split
        assert sorted(single) == sorted(order[step * 4:(step + 1) * 4].tolist())
    assert one.global_batch == two[0].global_batch == 4


def test_anchors_are_reproducible_and_resampled_each_epoch():
    a, b = _data(), _data()
    assert torch.equal(a.example(3, 0)["anchors"], b.example(3, 0)["anchors"])
    assert not torch.equal(a.example(3, 0)["anchors"], a.example(3, 1)["anchors"])
    assert torch.equal(a.epoch_order(2), b.epoch_order(2))
    assert not torch.equal(a.epoch_order(0), a.epoch_order(1))
    assert _data(shuffle=False).epoch_order(5).tolist() == list(range(6))


def test_truncation_is_counted():
    data = _data()
    assert data.num_truncated == 1  # only the row of 40 exceeds max_length=32
    assert data.example(3, 0)["input_ids"].numel() == 32


def test_example_rules_hold_per_block():
    ex = _data().example(1, 0)
    x, anchors, labels = ex["input_ids"], ex["anchors"], ex["labels"]
    assert anchors.numel() == 4
    assert torch.equal(ex["block_ids"][:, 0], x[anchors])
    assert (ex["block_ids"][:, 1:] == MASK).all()
    assert (labels[:, 0] == IGNORE_INDEX).all()
    for j, p in enumerate(anchors.tolist()):
        for k in range(1, 4):
            if labels[j, k] != IGNORE_INDEX:
                assert labels[j, k] == x[p + k]


def test_packed_rows_restart_positions_and_keep_labels_inside_documents():
    data = _data(lengths=(10, 12, 8, 6), packing=True, max_length=32, num_anchors=8)
    assert data.groups == [[0, 1, 2], [3]]
    ex = data.example(0, 0)
    docs = ex["doc_ids"]
    assert ex["input_ids"].numel() == 30
    assert ex["position_ids"][10].item() == 0 and ex["position_ids"][22].item() == 0
    for j, p in enumerate(ex["anchors"].tolist()):
        for k in range(4):
            if ex["labels"][j, k] != IGNORE_INDEX:
                assert docs[p + k] == docs[p]


def test_collate_pads_rows_and_blocks():
    data = _data(lengths=(20, 9), num_anchors=4, shuffle=False)
    batch = collate([data.example(0, 0), data.example(1, 0)], MASK)
    assert batch.input_ids.shape == (2, 20)
    assert batch.attention_mask[1].sum() == 9
    n = batch.anchors.shape[1]
    assert batch.block_ids.shape == batch.labels.shape == batch.block_position_ids.shape == (2, n * 4)
    n1 = data.example(1, 0)["anchors"].numel()
    assert batch.anchor_valid[1].sum() == n1
    assert (batch.labels[1, n1 * 4:] == IGNORE_INDEX).all()
    assert batch.doc_ids is None


def test_packed_conversations_get_the_anchors_they_would_get_alone():
    """Anchors are budgeted per conversation: the same cap, the same seed, the same draw."""
    lengths = (10, 12, 8, 6, 30, 7)
    alone = _data(lengths=lengths, num_anchors=3, max_length=32)
    packed = _data(lengths=lengths, num_anchors=3, max_length=32, packing=True)
    assert any(len(g) > 1 for g in packed.groups)
    for epoch in (0, 1):
        for row, group in enumerate(packed.groups):
            ex = packed.example(row, epoch)
            starts = torch.nonzero(ex["position_ids"] == 0).flatten().tolist()
            expect = torch.cat([alone.example(i, epoch)["anchors"] + s for i, s in zip(group, starts)])
            assert torch.equal(ex["anchors"], expect)
    # A short conversation keeps its anchors beside a long one (no row-wide cap starves it).
    row = next(r for r, g in enumerate(packed.groups) if 5 in g)
    docs = packed.example(row, 0)["doc_ids"]
    short_doc = packed.groups[row].index(5)
    n_short = (docs[packed.example(row, 0)["anchors"]] == short_doc).sum()
    assert n_short == alone.example(5, 0)["anchors"].numel() == 3


def test_anchor_counts_match_the_contract_per_conversation():
    from dflash_train import contract
    from dflash_train.data.dataset import anchor_counts

    ds = _rows((20, 30, 1, 2, 40, 25))
    counts = anchor_counts(ds, max_length=32, num_anchors=9, rows_per_pass=4)
    for i in range(len(ds)):
        mask = torch.tensor(ds[i]["loss_mask"][:32])
        assert counts[i] == min(contract.anchor_candidates(mask).numel(), 9)


def test_fixed_shapes_pack_by_blocks_and_pad_every_row_to_the_same_shape():
    data = _data(lengths=(10, 12, 8, 6, 30, 7), packing=True, max_length=32, num_anchors=3, blocks_per_row=6)
    assert data.fixed_shape == (32, 6)
    for row, group in enumerate(data.groups):
        assert data.example(row, 0)["anchors"].numel() <= 6
    batch = collate([data.example(0, 0)], MASK, shape=data.fixed_shape, rows=3)  # 2 filler rows
    assert batch.input_ids.shape == batch.doc_ids.shape == (3, 32)
    assert batch.labels.shape == batch.block_ids.shape == (3, 6 * 4) and batch.anchors.shape == (3, 6)
    assert not batch.anchor_valid[1:].any() and (batch.labels[1:] == IGNORE_INDEX).all()
    assert (batch.doc_ids[1:] == PAD_DOC).all() and batch.attention_mask[1:, 0].all()
    ex = data.example(0, 0)
    assert batch.stats.rows == 1 and batch.stats.tokens == ex["input_ids"].numel()
    assert batch.stats.conversations == len(data.groups[0])
    assert batch.stats.blocks == ex["anchors"].numel()
    assert batch.stats.supervised == batch.supervised_index.numel() == (batch.labels != IGNORE_INDEX).sum()
    assert torch.equal(batch.labels.flatten()[batch.supervised_index], ex["labels"][ex["labels"] != IGNORE_INDEX])
    with pytest.raises(ValueError, match="does not fit the fixed shape"):
        collate([data.example(0, 0)], MASK, shape=(8, 6))
    with pytest.raises(ValueError, match="blocks_per_row=2 is below data.num_anchors=3"):
        _data(packing=True, num_anchors=3, blocks_per_row=2)
