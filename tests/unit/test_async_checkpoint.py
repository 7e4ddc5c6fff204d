"""Checkpoints written on a background thread (checkpoint.async_write): the same files as a
synchronous save of the same step, never a later step's state, their errors raised in the
training process, and an interrupted write resumed from the previous checkpoint.

Faults and delays are injected at the write primitive (torch.save), as test_disk_full does."""

import errno
import json
import os
import threading
from pathlib import Path

import pytest
import torch

from dflash_train import train
from dflash_train.atomic import DiskFullError
from dflash_train.training.checkpoint import TMP_PREFIX, list_checkpoints
from dflash_train.training.run_dir import checkpoint_root
from dflash_train.training.trainer import Trainer
from tests.checkpoint_compare import assert_same_checkpoint
from tests.train_data import tiny_inputs, tiny_train_args, tiny_train_config

STEPS = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_inputs(tmp_path_factory.mktemp("async_ckpt"))


def _cfg(tiny, out, async_write, **kw):
    return tiny_train_config(tiny["target"], tiny["data"], out,
                             checkpoint={"every": 1, "keep_last": STEPS, "async_write": async_write}, **kw)


@pytest.fixture(scope="module")
def synchronous(tiny, tmp_path_factory):
    """A run whose every step is checkpointed synchronously: the files to compare with."""
    out = tmp_path_factory.mktemp("sync") / "run"
    Trainer(_cfg(tiny, out, async_write=False, max_steps=STEPS)).fit()
    return out


def test_background_checkpoints_hold_what_synchronous_ones_do(tiny, synchronous, tmp_path):
    out = tmp_path / "run"
    Trainer(_cfg(tiny, out, async_write=True, max_steps=STEPS)).fit()
    got, want = list_checkpoints(out), list_checkpoints(synchronous)
    assert [p.name for p in got] == [p.name for p in want] == [f"step_{s:08d}" for s in range(1, STEPS + 1)]
    for g, w in zip(got, want):
        assert_same_checkpoint(g, w)
    assert not list(checkpoint_root(out).glob(TMP_PREFIX + "*"))


def test_the_steps_after_a_save_do_not_leak_into_its_files(tiny, synchronous, tmp_path, monkeypatch):
    """The write of step 1 is held back until step 2 has changed every weight and moment in
    place: its files still hold step 1's state."""
    release = threading.Event()
    real_save = torch.save

    def held_save(obj, f, *args, **kwargs):
        if Path(f).name == "model.pt":
            assert release.wait(120), "the test never released the write"
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", held_save)
    out = tmp_path / "run"
    trainer = Trainer(_cfg(tiny, out, async_write=True, max_steps=STEPS))
    trainer.train_step(0)
    trainer.state.step = 1
    trainer.save()
    trainer.train_step(1)  # while the write of step 1 waits
    release.set()
    trainer.finish_checkpoint()
    (got,) = list_checkpoints(out)
    assert_same_checkpoint(got, list_checkpoints(synchronous)[0])
    # and step 2 did change the live weights in place, after the snapshot
    saved = torch.load(got / "model.pt", weights_only=True)
    trained = [(k, p) for k, p in trainer.drafter.named_parameters() if p.requires_grad]
    assert trained and all(not torch.equal(saved[k], p) for k, p in trained)


def _failing_save(monkeypatch, step: int, error: int):
    """torch.save fails half-way through the model file of checkpoint ``step``, which only the
    background thread writes."""
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if Path(f).name == "model.pt" and f".tmp-step_{step:08d}" in str(f):
            Path(f).write_bytes(b"\0" * 100)
            raise OSError(error, os.strerror(error), str(f))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


def _failed_run(tiny, run, capsys, max_steps: int) -> list[str]:
    """dflash-train checkpointing every step into ``run``, which must exit with status 2:
    the error lines it printed."""
    with pytest.raises(SystemExit) as stop:
        train.main(tiny_train_args(tiny["target"], tiny["data"], run, "checkpoint.every=1", f"max_steps={max_steps}"))
    assert stop.value.code == 2
    return [line for line in capsys.readouterr().err.splitlines() if "error" in line]


def test_a_failed_background_write_ends_the_run_at_the_next_save(tiny, tmp_path, monkeypatch, capsys):
    _failing_save(monkeypatch, step=2, error=errno.ENOSPC)
    run = tmp_path / "run"
    err = _failed_run(tiny, run, capsys, max_steps=4)
    # the same line a synchronous save gives
    assert err == [f"dflash-train: error: no space left on the disk of '{run / 'checkpoints'}' while writing checkpoint "
                   "step_00000002; its partial folder was removed and the last checkpoint, step_00000001, is kept: "
                   "free some space and run the same command again"]
    # raised at step 3's save, before step 3 was written; step 2 left nothing
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000001"]
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_a_failed_last_write_ends_the_run_before_the_export(tiny, tmp_path, monkeypatch):
    _failing_save(monkeypatch, step=2, error=errno.ENOSPC)
    out = tmp_path / "run"
    trainer = Trainer(tiny_train_config(tiny["target"], tiny["data"], out, max_steps=2, export=True))
    with pytest.raises(DiskFullError) as failed:
        trainer.fit()
    assert "\n" not in str(failed.value)
    assert str(failed.value).startswith("no space left on the disk of ")
    assert "checkpoint step_00000002; its partial folder was removed and there is no earlier checkpoint" \
        in str(failed.value)
    assert list((out / "checkpoints").iterdir()) == []
    assert not (out / "export").exists()


def test_a_refused_background_write_is_one_line(tiny, tmp_path, monkeypatch, capsys):
    _failing_save(monkeypatch, step=1, error=errno.EACCES)
    run = tmp_path / "run"
    err = _failed_run(tiny, run, capsys, max_steps=3)
    tmp = run / "checkpoints" / ".tmp-step_00000001"
    assert err == [f"dflash-train: error: Permission denied: {tmp / 'model.pt'}"]
    assert list((run / "checkpoints").iterdir()) == []


def test_a_write_cut_short_resumes_from_the_previous_checkpoint(tiny, synchronous, tmp_path):
    """A run killed while step 3 was written in the background left only its .tmp- folder:
    the same command resumes from step 2 and ends where an uninterrupted run ends."""
    out = tmp_path / "run"
    Trainer(_cfg(tiny, out, async_write=True, max_steps=3)).fit()
    root = checkpoint_root(out)
    # What a kill -9 during the write leaves: the folder not yet renamed, its files partial.
    partial = root / (TMP_PREFIX + "step_00000003")
    (root / "step_00000003").rename(partial)
    (partial / "checksums.json").unlink()
    (partial / "model.pt").write_bytes((partial / "model.pt").read_bytes()[:100])
    resumed = Trainer(_cfg(tiny, out, async_write=True, max_steps=STEPS))
    resumed.resume()
    assert resumed.state.step == 2
    resumed.fit()
    assert not partial.exists()
    for got, want in zip(list_checkpoints(out)[-2:], list_checkpoints(synchronous)[-2:]):
        assert_same_checkpoint(got, want)
