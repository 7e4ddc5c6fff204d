"""The training loop on a tiny random target: golden numbers, resume, NaN handling, bad input."""

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from dflash_train.training import trainer as trainer_mod
from dflash_train.training.checkpoint import list_checkpoints
from dflash_train.training.logging import METRICS_FILE
from dflash_train.training.trainer import NonFiniteLossError, Trainer, split_validation
from tests.train_data import save_tiny_target, tiny_inputs, tiny_train_config, write_datagen_dir

# Loss of the first three steps on the tiny target (seed 0); 8 rows, global batch 4.
GOLDEN_LOSSES = [10.8241842, 10.8074494, 10.6321191]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_inputs(tmp_path_factory.mktemp("tiny"))


def _cfg(tiny, out, **kw):
    return tiny_train_config(tiny["target"], tiny["data"], out, **kw)


def _metrics(out):
    return [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]


def _weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.drafter.state_dict().items()}


def test_golden_first_steps(tiny, tmp_path):
    Trainer(_cfg(tiny, tmp_path, max_steps=3)).fit()
    losses = [m["loss"] for m in _metrics(tmp_path)]
    assert losses == pytest.approx(GOLDEN_LOSSES, rel=1e-4)


def test_resume_continues_to_the_same_weights(tiny, tmp_path):
    straight = Trainer(_cfg(tiny, tmp_path / "a", max_steps=4))
    straight.fit()
    first = Trainer(_cfg(tiny, tmp_path / "b", max_steps=2))
    first.fit()
    resumed = Trainer(_cfg(tiny, tmp_path / "b", max_steps=4))
    resumed.resume()
    assert resumed.state.step == 2
    resumed.fit()
    for k, v in _weights(straight).items():
        assert torch.equal(v, _weights(resumed)[k]), k


def test_keep_last_checkpoints(tiny, tmp_path):
    Trainer(_cfg(tiny, tmp_path, max_steps=4, checkpoint={"every": 1, "keep_last": 2})).fit()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_resume_with_another_global_batch_is_refused(tiny, tmp_path):
    Trainer(_cfg(tiny, tmp_path, max_steps=1)).fit()
    with pytest.raises(ValueError, match="global batch 4 but this run has 2"):
        Trainer(_cfg(tiny, tmp_path, optim={"grad_accum_steps": 1})).resume()


def _spoil_loss_calls(monkeypatch, calls: set[int], spoil) -> None:
    """Trainer.loss with ``spoil(weighted_sum)`` applied on the given (1-based) calls."""
    real_loss, seen = Trainer.loss, {"n": 0}

    def loss(self, batch, hidden, *rest):
        out = real_loss(self, batch, hidden, *rest)
        seen["n"] += 1
        if seen["n"] in calls:
            out.weighted_sum = spoil(out.weighted_sum)
        return out

    monkeypatch.setattr(Trainer, "loss", loss)


def test_nan_loss_is_skipped_and_counted_then_aborts(tiny, tmp_path, monkeypatch):
    real_loss = Trainer.loss
    _spoil_loss_calls(monkeypatch, {3, 4}, lambda x: x * float("nan"))  # both micro-batches of step 2
    t = Trainer(_cfg(tiny, tmp_path, max_steps=3, max_nan_skips=1))
    t.fit()
    assert t.state.nan_skipped == 1
    lines = _metrics(tmp_path)
    assert [m["nan_skipped"] for m in lines] == [0, 1, 1]
    assert all(torch.isfinite(p).all() for p in t.drafter.parameters())

    monkeypatch.setattr(Trainer, "loss", lambda self, b, h, *rest: _nan(real_loss(self, b, h, *rest)))
    with pytest.raises(NonFiniteLossError, match="max_nan_skips=1"):
        Trainer(_cfg(tiny, tmp_path / "always", max_nan_skips=1)).fit()


def _nan(out):
    out.weighted_sum = out.weighted_sum * float("nan")
    return out


class _InfGradient(torch.autograd.Function):
    """Identity forward (the loss stays finite), infinite gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


def test_finite_loss_with_infinite_gradients_is_skipped(tiny, tmp_path, monkeypatch):
    real_loss = Trainer.loss
    _spoil_loss_calls(monkeypatch, {3}, _InfGradient.apply)  # first micro-batch of step 2
    t = Trainer(_cfg(tiny, tmp_path / "skip", max_steps=2))
    t.fit()
    assert t.state.nan_skipped == 1
    lines = _metrics(tmp_path / "skip")
    assert [m["nan_skipped"] for m in lines] == [0, 1]
    # The skipped step left weights, Adam moments and the schedule exactly as after step 1.
    monkeypatch.setattr(Trainer, "loss", real_loss)
    one = Trainer(_cfg(tiny, tmp_path / "one", max_steps=1))
    one.fit()
    skipped = _weights(t)
    for k, v in _weights(one).items():
        assert torch.equal(v, skipped[k]), k
    assert t.backend.lr() == one.backend.lr()
    exp_avg = lambda tr: [s["exp_avg"] for s in tr.backend.optimizer.state.values()]  # noqa: E731
    assert all(torch.equal(a, b) for a, b in zip(exp_avg(t), exp_avg(one), strict=True))


def test_data_for_another_target_fails_before_loading_a_model(tiny, tmp_path, monkeypatch):
    other = save_tiny_target(tmp_path / "other", tiny["tok"], layers=4)
    data = write_datagen_dir(tmp_path / "data", other, tiny["tok"])
    monkeypatch.setattr(trainer_mod, "load_target", lambda *a, **k: pytest.fail("loaded the target"))
    with pytest.raises(ValueError, match="regenerate the data"):
        Trainer(tiny_train_config(tiny["target"], data, tmp_path / "run"))


def test_empty_dataset_fails_before_loading_a_model(tiny, tmp_path, monkeypatch):
    data = write_datagen_dir(tmp_path / "data", tiny["target"], tiny["tok"], rows=[])
    monkeypatch.setattr(trainer_mod, "load_target", lambda *a, **k: pytest.fail("loaded the target"))
    with pytest.raises(ValueError, match="empty"):
        Trainer(tiny_train_config(tiny["target"], data, tmp_path / "run"))


def test_too_few_rows_for_the_global_batch(tiny, tmp_path):
    with pytest.raises(ValueError, match="cannot fill one global batch of 16"):
        Trainer(_cfg(tiny, tmp_path, optim={"micro_batch_size": 4, "grad_accum_steps": 4}))


def test_missing_wandb_fails_before_loading_a_model(tiny, tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    monkeypatch.setattr(trainer_mod, "load_target", lambda *a, **k: pytest.fail("loaded the target"))
    with pytest.raises(ValueError, match="needs wandb"):
        Trainer(_cfg(tiny, tmp_path, logging={"wandb": "offline"}))


def test_cli_reports_an_unknown_recipe_key_in_one_line(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "dflash_train.train", "+data.num_anchor=3", "data.path=x", f"output_dir={tmp_path}"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 2
    assert "dflash-train: error: unknown key data.num_anchor (did you mean data.num_anchors?)" in done.stderr


def test_packed_rows_train(tiny, tmp_path):
    t = Trainer(_cfg(tiny, tmp_path, max_steps=2, data={"packing": True, "max_length": 128},
                     optim={"micro_batch_size": 1, "grad_accum_steps": 1}))
    assert len(t.data) < 8  # several conversations per row
    batch = t.micro_batches(0)[0]
    assert batch.doc_ids is not None and batch.doc_ids.max() > 0
    t.fit()
    assert all(m["loss"] > 0 for m in _metrics(tmp_path))


def test_validation_split_is_seeded_and_disjoint():
    train, val = split_validation(10, 3, seed=0)
    assert len(val) == 3 and sorted(train + val) == list(range(10))
    assert split_validation(10, 3, seed=0) == (train, val)
    assert split_validation(10, 3, seed=1) != (train, val)
    with pytest.raises(ValueError, match=r"data.val_rows=10 leaves no training rows \(the dataset has 10\)"):
        split_validation(10, 10, seed=0)


def test_validation_is_logged_and_does_not_touch_training(tiny, tmp_path):
    every = Trainer(_cfg(tiny, tmp_path / "every", epochs=3, data={"val_rows": 3, "val_every": 1}))
    every.fit()
    end = Trainer(_cfg(tiny, tmp_path / "end", epochs=3, data={"val_rows": 3}))
    end.fit()
    lines = _metrics(tmp_path / "every")
    assert len(every.data) == 5 and len(every.val_data) == 3
    assert len(lines) == 3 and all("val_loss" in m and "val_acc_pos_7" in m for m in lines)
    assert [("val_loss" in m) for m in _metrics(tmp_path / "end")] == [False, False, True]
    # validating after every step changed neither the weights nor the final numbers
    for k, v in _weights(end).items():
        assert torch.equal(v, _weights(every)[k]), k
    final = _metrics(tmp_path / "end")[-1]
    for key in ("val_loss", "val_expected_tau", "val_tau"):
        assert final[key] == lines[-1][key], key
    # the same number again from the trained drafter: validation is deterministic
    again = end.validate()
    assert again["val_loss"] == pytest.approx(final["val_loss"], rel=1e-6) and again["val_tau"] == final["val_tau"]
    # blocks of 8 accept at most 7 drafts
    assert 1.0 <= final["val_expected_tau"] <= 8.0 and 1.0 <= final["val_tau"] <= 8.0 and final["val_loss"] > 0
    assert all(1.0 <= m["tau"] <= 8.0 for m in lines)


def test_progress_bar_keeps_the_last_validation_tau(tmp_path):
    from dflash_train.config import LoggingConfig
    from dflash_train.training.logging import MetricsLogger

    logger = MetricsLogger(LoggingConfig(wandb="disabled", progress_bar=True), tmp_path, 10, 0, True, {})
    logger.log(1, {"loss": 2.5, "expected_tau": 1.25, "tau": 1.5})
    assert "val_tau" not in logger.bar.postfix
    logger.log(2, {"loss": 2.0, "expected_tau": 1.5, "tau": 1.625, "val_expected_tau": 1.125, "val_tau": 1.25})
    logger.log(3, {"loss": 1.5, "expected_tau": 1.75, "tau": 2.0})
    # the bar shows the taus counted block by block; metrics.jsonl keeps both kinds
    assert logger.bar.postfix == "loss=1.500, tau=2.00, val_tau=1.25"
    logger.close()
    lines = [json.loads(line) for line in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert [(m.get("val_expected_tau"), m.get("val_tau")) for m in lines] == [(None, None), (1.125, 1.25), (None, None)]
