"""The training-data rules of contract section 2, one test per rule."""

import math

import pytest
import torch

from dflash_train import contract
from dflash_train.contract import IGNORE_INDEX

MASK = 99


def test_gamma_defaults_follow_the_paper():
    assert [contract.default_gamma(b) for b in (16, 10, 8)] == [7.0, 5.0, 4.0]
    with pytest.raises(ValueError, match="block_size=12"):
        contract.default_gamma(12)


def test_slot_weights_decay_from_the_first_draft_slot():
    w = contract.slot_weights(16, 7.0)
    assert w[0] == 0  # the anchor slot is never supervised
    assert w[1] == 1
    assert torch.allclose(w[1:], torch.exp(-torch.arange(15.0) / 7.0))
    assert math.isclose(float(w[15]), math.exp(-14 / 7), rel_tol=1e-6)
    with pytest.raises(ValueError):
        contract.slot_weights(8, 0.0)


def test_anchor_candidates_need_a_supervised_next_token():
    loss_mask = torch.tensor([0, 0, 1, 1, 0, 1, 1])
    # p + 1 supervised and p + 1 < T: p in {1, 2, 4, 5}; p = 6 is last and has no next token.
    assert contract.anchor_candidates(loss_mask).tolist() == [1, 2, 4, 5]
    docs = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    assert contract.anchor_candidates(loss_mask, docs).tolist() == [1, 2, 4, 5]
    docs = torch.tensor([0, 0, 0, 1, 1, 1, 1])  # position 3 starts a new document
    assert contract.anchor_candidates(loss_mask, docs).tolist() == [1, 4, 5]


def test_anchors_are_distinct_sorted_and_seeded():
    cands = torch.arange(10, 200, 3)
    a = contract.sample_anchors(cands, 16, seed=123)
    assert a.numel() == 16 and a.unique().numel() == 16
    assert torch.equal(a, a.sort().values)
    assert set(a.tolist()) <= set(cands.tolist())
    assert torch.equal(a, contract.sample_anchors(cands, 16, seed=123))
    assert not torch.equal(a, contract.sample_anchors(cands, 16, seed=124))
    assert torch.equal(contract.sample_anchors(cands[:5], 16, seed=1), cands[:5])  # fewer: all of them


def test_anchor_seed_depends_on_seed_epoch_and_index_only():
    s = contract.anchor_seed(0, 1, 7)
    assert s == contract.anchor_seed(0, 1, 7)
    assert len({s, contract.anchor_seed(0, 2, 7), contract.anchor_seed(0, 1, 8), contract.anchor_seed(1, 1, 7)}) == 4
    assert 0 <= s < 2**63
    assert s == 1623713341612777640  # pinned: changing the derivation changes every run's anchors


def test_block_inputs_are_the_anchor_token_then_masks():
    x = torch.arange(100, 120)
    ids = contract.block_input_ids(x, torch.tensor([3, 10]), 4, MASK)
    assert ids.tolist() == [[103, MASK, MASK, MASK], [110, MASK, MASK, MASK]]


def test_labels_are_same_position_and_filtered():
    x = torch.arange(100, 110)  # T = 10
    loss_mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 1, 1])
    labels = contract.block_labels(x, loss_mask, torch.tensor([1, 7]), 4)
    # slot k predicts x[p + k]; slot 0 never; loss_mask 0 at 5; positions >= T ignored.
    assert labels.tolist() == [[IGNORE_INDEX, 102, 103, 104], [IGNORE_INDEX, 108, 109, IGNORE_INDEX]]


def test_labels_never_cross_into_the_next_packed_document():
    x = torch.arange(100, 108)
    loss_mask = torch.ones(8, dtype=torch.long)
    docs = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    labels = contract.block_labels(x, loss_mask, torch.tensor([2]), 4, docs)
    assert labels.tolist() == [[IGNORE_INDEX, 103, IGNORE_INDEX, IGNORE_INDEX]]


def test_block_positions_follow_the_anchor_position():
    pos = torch.tensor([0, 1, 2, 0, 1, 2, 3])  # a packed row: second document restarts at 0
    assert contract.block_position_ids(pos, torch.tensor([1, 4]), 3).tolist() == [[1, 2, 3], [1, 2, 3]]


def test_expected_acceptance_length_from_position_accuracies():
    assert contract.expected_acceptance_length(torch.tensor([1.0, 1.0, 1.0])) == 4.0
    assert contract.expected_acceptance_length(torch.zeros(15)) == 1.0
    assert math.isclose(contract.expected_acceptance_length(torch.tensor([0.5, 0.5])), 1.75)
    assert math.isclose(contract.expected_acceptance_length(torch.tensor([0.5, float("nan"), 1.0])), 1.5)


def test_loss_weight_sum_counts_supervised_slots_per_block():
    w = contract.slot_weights(4, 2.0)
    labels = torch.tensor([[IGNORE_INDEX, 5, 6, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, 7, 8]])  # 2 blocks
    expected = w[1] + w[2] + w[2] + w[3]
    assert torch.isclose(contract.loss_weight_sum(labels, w), expected)


def test_derive_seed_is_pinned_for_training_and_data_generation():
    # The trainer's streams (anchors, shuffle) and data generation's sampling seeds each keep
    # the hash their numbers were made with: moving either changes existing runs and data.
    assert contract.derive_seed("anchors", 0, 1, 2) == 8365346278003766774
    assert contract.derive_seed("shuffle", 0, 0) == 1766106962148851731
    turn = contract.derive_seed(7, 0, 0, digest="sha256")  # (seed, shard, turn)
    assert (turn, contract.derive_seed(turn, 0, digest="sha256")) == (1209531046005782473, 3527862439050271925)
    assert contract.derive_seed(0, 3, digest="sha256") & 0x7FFFFFFF == 2039725804  # an openai request seed
    with pytest.raises(ValueError, match="digest must be 'blake2b' or 'sha256', got 'md5'"):
        contract.derive_seed(1, digest="md5")
