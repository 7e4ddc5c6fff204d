"""Data path: packing bookkeeping, per-rank slices of the global batch, per-epoch anchors, collate."""

import datasets
import torch

from dflash_train.contract import IGNORE_INDEX
from dflash_train.data.collate import collate
from dflash_train.data.dataset import StepSlice, TrainingData
from dflash_train.data.packing import (
    PAD_DOC,
    document_causal_mask,
    document_ids,
    document_positions,
    pack_by_length,
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


def test_pack_by_length_keeps_order_and_budget():
    rows = pack_by_length([5, 4, 3, 9, 2, 20], 10)
    assert rows == [[0, 1], [2], [3], [4], [5]]  # every sample once, in order
    assert pack_by_length([3, 3, 3, 3], 10) == [[0, 1, 2], [3]]


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
