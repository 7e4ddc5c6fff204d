"""data.cache_features: each training row's target features kept after its first forward.

A run with the cache computes what a run without it computes (the same losses and weights),
while the frozen target runs once per training row instead of once per row and epoch."""

import json

import pytest
import torch

from dflash_train.data.collate import collate
from dflash_train.model.target import TargetModel
from dflash_train.training.logging import METRICS_FILE
from dflash_train.training.trainer import Trainer
from tests.train_data import tiny_inputs, tiny_train_config

TARGET_FEATURES = TargetModel.features


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_inputs(tmp_path_factory.mktemp("tiny"))


def _run(tiny, out, monkeypatch, **kw):
    """Train; returns (losses per step, final weights, rows the target's forward was run on)."""
    rows_run = []

    def counting(self, input_ids, *args, **kwargs):
        rows_run.append(input_ids.shape[0])
        return TARGET_FEATURES(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(TargetModel, "features", counting)
    trainer = Trainer(tiny_train_config(tiny["target"], tiny["data"], out, **kw))
    trainer.fit()
    losses = [json.loads(line)["loss"] for line in (out / METRICS_FILE).read_text().splitlines()
              if '"loss"' in line]
    weights = {k: v.detach().clone() for k, v in trainer.drafter.state_dict().items()}
    return losses, weights, rows_run, trainer


def test_one_row_a_step_trains_bit_for_bit_the_same_and_runs_the_target_once_a_row(tiny, tmp_path, monkeypatch):
    # 8 rows, one a step, 3 epochs: 24 steps, 24 target forwards without the cache, 8 with it.
    kw = dict(optim={"micro_batch_size": 1, "grad_accum_steps": 1}, epochs=3)
    plain_losses, plain_weights, plain_rows, _ = _run(tiny, tmp_path / "plain", monkeypatch, **kw)
    cached_losses, cached_weights, cached_rows, trainer = _run(tiny, tmp_path / "cached", monkeypatch,
                                                               data={"cache_features": True}, **kw)
    assert len(plain_losses) == 24 and cached_losses == plain_losses
    for name, value in plain_weights.items():
        assert torch.equal(cached_weights[name], value), name
    assert sum(plain_rows) == 24 and sum(cached_rows) == 8
    assert len(trainer.feature_cache) == 8


def test_padded_micro_batches_read_their_rows_back_from_other_batches(tiny, tmp_path, monkeypatch):
    # Two rows a micro-batch: rows meet other rows (another padded length) in later epochs,
    # so their kept features are re-padded; the losses agree to float32 rounding.
    plain_losses, plain_weights, _, _ = _run(tiny, tmp_path / "plain", monkeypatch)
    cached_losses, cached_weights, cached_rows, _ = _run(tiny, tmp_path / "cached", monkeypatch,
                                                         data={"cache_features": True})
    assert cached_losses == pytest.approx(plain_losses, rel=1e-5)
    for name, value in plain_weights.items():
        torch.testing.assert_close(cached_weights[name], value, rtol=1e-4, atol=1e-6)
    assert sum(cached_rows) == 8  # epoch 1 only: each of the 8 rows once


def test_packed_rows_of_a_fixed_shape(tiny, tmp_path, monkeypatch):
    # Packed rows (several conversations, document masks) padded to one fixed shape; an
    # epoch's order leaves some rows out, so rows are first met in later epochs too.
    kw = dict(data={"packing": True, "max_length": 96, "blocks_per_row": 16},
              optim={"micro_batch_size": 3, "grad_accum_steps": 1}, epochs=3)
    plain_losses, _, plain_rows, _ = _run(tiny, tmp_path / "plain", monkeypatch, **kw)
    cached_kw = dict(kw, data={**kw["data"], "cache_features": True})
    cached_losses, _, cached_rows, trainer = _run(tiny, tmp_path / "cached", monkeypatch, **cached_kw)
    assert cached_losses == pytest.approx(plain_losses, rel=1e-5)
    # A micro-batch with one row not kept yet runs the target on all of its rows.
    assert len(trainer.feature_cache) <= sum(cached_rows) < sum(plain_rows)
    assert 0 < len(trainer.feature_cache) <= len(trainer.data)


def test_a_batch_with_a_row_not_kept_runs_the_target(tiny, tmp_path):
    trainer = Trainer(tiny_train_config(tiny["target"], tiny["data"], tmp_path,
                                        data={"cache_features": True}))
    first, second = trainer.micro_batches(0)[:2]
    trainer.target_inputs(first)
    assert len(trainer.feature_cache) == 2
    assert trainer.feature_cache.get(second) is None  # its rows are not kept yet
    mixed = collate([trainer.data.example(r, 0) for r in (*first.data_rows[:1], *second.data_rows[:1])],
                    16, data_rows=[first.data_rows[0], second.data_rows[0]])
    assert trainer.feature_cache.get(mixed) is None
    feats, _, _ = trainer.target_inputs(mixed)  # runs the target, and keeps the new row
    assert len(trainer.feature_cache) == 3
    torch.testing.assert_close(trainer.feature_cache.get(mixed), feats)


def test_collate_refuses_data_rows_that_do_not_match_the_examples(tiny, tmp_path):
    trainer = Trainer(tiny_train_config(tiny["target"], tiny["data"], tmp_path))
    examples = [trainer.data.example(r, 0) for r in (0, 1)]
    with pytest.raises(ValueError, match="3 data rows for 2 examples"):
        collate(examples, 16, data_rows=[0, 1, 2])


def test_the_cache_with_distillation_is_refused_by_name(tiny, tmp_path):
    with pytest.raises(ValueError, match=r"data.cache_features=true with loss.distill_weight=0.5"):
        tiny_train_config(tiny["target"], tiny["data"], tmp_path, data={"cache_features": True},
                          loss={"distill_weight": 0.5})
