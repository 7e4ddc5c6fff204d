"""Packed rows: the frozen target sees each conversation exactly as it would alone.

Several conversations share one row; the trainer's target forward must keep them apart
(block-diagonal causal attention, positions restarting at 0), or a conversation's context
features silently depend on the conversations packed before it. Checked through the
trainer's own path (`micro_batches` -> `target_inputs`) against the target run on each
conversation alone, using only public Batch fields, so the check survives changes in how
rows are padded or masked.
"""

import dataclasses

import pytest
import torch

from dflash_train.data.packing import PAD_DOC
from dflash_train.model.target import load_tokenizer
from dflash_train.training.trainer import Trainer
from tests.conftest import SMOLLM2
from tests.train_data import save_tiny_target, tiny_train_config, write_datagen_dir

ATOL = 1e-5  # float32 on CPU: a correct packed forward differs from the lone one by rounding only


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A Trainer on packed rows (micro-batches of 2 rows, so the shorter row is padded) and
    the micro-batches of its first epoch."""
    root = tmp_path_factory.mktemp("packed")
    tok = load_tokenizer(SMOLLM2)
    target = save_tiny_target(root / "target", tok)
    data = write_datagen_dir(root / "data", target, tok, repeat=2)
    cfg = tiny_train_config(target, data, root / "out", data={"packing": True, "max_length": 160},
                            optim={"micro_batch_size": 2, "grad_accum_steps": 1})
    trainer = Trainer(cfg)
    batches = [b for step in range(trainer.steps_per_epoch) for b in trainer.micro_batches(step)]
    return trainer, batches


def _documents(batch):
    """(row, doc, token indices) of every conversation of a packed batch; padding excluded."""
    for r in range(batch.doc_ids.shape[0]):
        for d in batch.doc_ids[r].unique().tolist():
            if d != PAD_DOC:
                yield r, d, (batch.doc_ids[r] == d).nonzero().flatten()


def _alone(trainer, ids):
    """The target's features of one conversation on its own, positions 0..L-1: (L, n*H)."""
    with torch.inference_mode():
        return trainer.target.features(ids[None], trainer.layer_ids,
                                       position_ids=torch.arange(ids.numel())[None])[0]


def _errors(trainer, batch, feats):
    """{(row, doc): max |packed - alone|} over the conversation's tokens."""
    return {(r, d): (feats[r, idx].float() - _alone(trainer, batch.input_ids[r, idx]).float()).abs().max().item()
            for r, d, idx in _documents(batch)}


def test_packed_features_equal_each_conversation_alone(packed):
    trainer, batches = packed
    assert any(b.doc_ids.max() > 0 for b in batches)  # some row does pack several conversations
    for batch in batches:
        for r, d, idx in _documents(batch):
            # the reference below runs positions 0..L-1: the packed row must restart them too
            assert torch.equal(batch.position_ids[r, idx], torch.arange(idx.numel())), (r, d)
        errors = _errors(trainer, batch, trainer.target_inputs(batch)[0])
        assert max(errors.values()) <= ATOL, errors


def test_a_plain_mask_would_be_caught(packed):
    # The bug this file guards against: packed rows forwarded like unpacked ones, with the
    # plain padding mask, so every conversation also attends to those packed before it.
    trainer, batches = packed
    batch = next(b for b in batches if b.doc_ids.max() > 0)
    leaky = trainer.target_inputs(dataclasses.replace(batch, doc_ids=None))[0]
    errors = _errors(trainer, batch, leaky)
    assert all(e <= ATOL for (_, d), e in errors.items() if d == 0)  # nothing before the first
    later = {k: e for k, e in errors.items() if k[1] > 0}
    assert later and min(later.values()) > 1000 * ATOL, errors


def test_unpadded_rows_run_without_a_mask(tmp_path, monkeypatch):
    """One conversation per row, no padding: the trainer passes no mask at all (HF would
    otherwise check an all-ones mask on the device and wait for it) and the features are
    the conversation's own; a padded micro-batch still gets its padding mask."""
    tok = load_tokenizer(SMOLLM2)
    target = save_tiny_target(tmp_path / "target", tok)
    data = write_datagen_dir(tmp_path / "data", target, tok, repeat=1)
    cfg = tiny_train_config(target, data, tmp_path / "out", optim={"micro_batch_size": 1, "grad_accum_steps": 1})
    trainer = Trainer(cfg)
    masks, positions = [], []
    features = trainer.target.features
    monkeypatch.setattr(trainer.target, "features",
                        lambda *a, **kw: masks.append(kw.get("attention_mask"))
                        or positions.append(kw.get("position_ids")) or features(*a, **kw))
    batch = trainer.micro_batches(0)[0]
    assert batch.doc_ids is None and batch.stats.tokens == batch.input_ids.numel()
    assert torch.equal(batch.position_ids[0], torch.arange(batch.input_ids.shape[1]))  # HF's default
    feats = trainer.target_inputs(batch)[0]
    assert masks == [None] and positions == [None]
    assert (feats[0].float() - _alone(trainer, batch.input_ids[0]).float()).abs().max().item() <= ATOL

    padded = Trainer(tiny_train_config(target, data, tmp_path / "out2",
                                       optim={"micro_batch_size": 2, "grad_accum_steps": 1}))
    padded_features = padded.target.features
    monkeypatch.setattr(padded.target, "features",
                        lambda *a, **kw: masks.append(kw.get("attention_mask")) or padded_features(*a, **kw))
    batch = next(b for s in range(padded.steps_per_epoch) for b in padded.micro_batches(s)
                 if b.stats.tokens < b.input_ids.numel())
    padded.target_inputs(batch)
    assert torch.equal(masks[-1], batch.attention_mask)
