"""A disk that fills up while a checkpoint, an export or a dataset shard is written: one line
saying so, no partial output left under any name, the last good one kept. The full disk is
simulated at the write primitive (a fault injection): torch.save and pyarrow raise as they
do on a full disk."""

import errno
import os
from pathlib import Path

import pytest
import torch

from dflash_train import train
from dflash_train.atomic import DiskFullError, atomic_write, atomic_write_text
from dflash_train.training.checkpoint import latest_good_checkpoint, list_checkpoints
from tests.train_data import tiny_inputs, tiny_train_args


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_inputs(tmp_path_factory.mktemp("full"))


def _no_space(path) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def test_a_failed_write_leaves_nothing_and_keeps_the_previous_file(tmp_path):
    path = tmp_path / "results.json"
    atomic_write_text(path, "old\n")

    def write(tmp: Path):
        tmp.write_text("half")
        raise _no_space(tmp)

    with pytest.raises(DiskFullError) as err:
        atomic_write(path, write)
    assert str(err.value) == (f"no space left on the disk of '{tmp_path}' while writing {path}; nothing partial was "
                              "left there: free some space and run the same command again")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]  # no .results.json.tmp-PID
    assert path.read_text() == "old\n"


def test_a_library_error_on_a_full_disk_is_a_full_disk(tmp_path, monkeypatch):
    """torch.save on a full disk raises RuntimeError('... unexpected pos ...') without errno:
    the free space left says what happened. On a disk with room it stays the library's error."""
    def write(tmp: Path):
        (tmp / "model.pt").write_bytes(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed, unexpected pos 64 vs 1024")

    with pytest.raises(RuntimeError, match="unexpected pos") as err:
        atomic_write(tmp_path / "export", write, folder=True)
    assert not isinstance(err.value, DiskFullError)
    full = os.statvfs_result((4096, 4096, 100, 0, 0, 100, 0, 0, 0, 255))
    monkeypatch.setattr(os, "statvfs", lambda path: full)
    with pytest.raises(DiskFullError, match=r"^no space left on the disk of .* while writing .*export; nothing"):
        atomic_write(tmp_path / "export", write, folder=True)
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_while_a_checkpoint_is_written(tiny, tmp_path, monkeypatch, capsys):
    """The second checkpoint hits a full disk half-way: one line, its partial folder removed
    at once, the first one kept and good."""
    run = tmp_path / "run"
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if ".tmp-step_00000002" in str(f):
            Path(f).write_bytes(b"\0" * 100)
            raise _no_space(f)
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    with pytest.raises(SystemExit) as stop:
        train.main(tiny_train_args(tiny["target"], tiny["data"], run, "checkpoint.every=1", "max_steps=3"))
    assert stop.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # not the progress bars
    assert err == [f"dflash-train: error: no space left on the disk of '{run / 'checkpoints'}' while writing checkpoint "
                   "step_00000002; its partial folder was removed and the last checkpoint, step_00000001, is kept: "
                   "free some space and run the same command again"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000001"]
    assert latest_good_checkpoint(run) == list_checkpoints(run)[0]


def test_a_full_disk_while_a_shard_is_written(tmp_path, monkeypatch):
    from dflash_train.data import format as data_format

    def write_table(table, where):
        Path(where).write_bytes(b"PAR1")
        raise _no_space(where)

    monkeypatch.setattr(data_format.pq, "write_table", write_table)
    with pytest.raises(DiskFullError, match=r"while writing .*shard-00000.parquet; nothing partial was left there"):
        data_format.write_shard(tmp_path, 0, [], {})
    assert [p.name for p in (tmp_path / "shards").iterdir()] == []
