"""FSDP2 checkpoints written in the background (checkpoint.async_write: DCP's async_save, its
collectives on a gloo group of their own) by the real trainer on 2 gloo processes: the same
values as synchronous checkpoints of the same steps, never a later step's state, a job killed
while writing resumed from the previous checkpoint with the uninterrupted run's losses, and a
shard that fails on one rank raised on every rank at the next save, as the synchronous path's
one line.

The runs checkpoint every step (global batch 4: 2 processes x 2 micro-batches of 1 row).
Faults and delays are injected where DCP opens a shard file (tests/distributed/_checkpoint_worker.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from dflash_train.training.checkpoint import CHECKSUMS_FILE, TMP_PREFIX, list_checkpoints
from dflash_train.training.run_dir import checkpoint_root
from dflash_train.training.state_files import read_sharded
from tests.checkpoint_compare import assert_same_checkpoint
from tests.distributed._backend_worker import launch

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("_checkpoint_worker.py")
STEPS = 4
SHARDS = ["__0_0.distcp", "__1_0.distcp"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.train_data import tiny_inputs

    inputs = tiny_inputs(tmp_path_factory.mktemp("fsdp2_async"))
    return {"target": inputs["target"], "data": str(inputs["data"])}


def _run(tiny, output_dir: Path, async_write: bool, **kwargs) -> dict:
    """2 FSDP2 processes train (resuming from output_dir's checkpoint, if any) to STEPS,
    checkpointing every step; what rank 0 recorded."""
    return launch(2, output_dir.with_suffix(".pt"), script=WORKER, target=tiny["target"], data=tiny["data"],
                  output_dir=output_dir, async_write=int(async_write), max_steps=STEPS, **kwargs)


@pytest.fixture(scope="module")
def synchronous(tiny, tmp_path_factory):
    """The run whose every checkpoint is written synchronously: the files and losses to compare with."""
    out = tmp_path_factory.mktemp("sync") / "run"
    return out, _run(tiny, out, async_write=False)


@pytest.fixture(scope="module")
def background(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("async") / "run"
    return out, _run(tiny, out, async_write=True)


def _losses(record: dict) -> list[tuple[int, float]]:
    return [(m["step"], m["loss"]) for m in record["metrics"]]


def test_background_fsdp2_checkpoints_hold_what_synchronous_ones_do(synchronous, background):
    (want_dir, want), (got_dir, got) = synchronous, background
    assert got["ranks"] == want["ranks"] == [(0, "")] * 2
    assert _losses(got) == _losses(want) and len(got["metrics"]) == STEPS
    checkpoints = list_checkpoints(got_dir)
    assert [p.name for p in checkpoints] == [p.name for p in list_checkpoints(want_dir)] \
        == [f"step_{s:08d}" for s in range(1, STEPS + 1)]
    for g, w in zip(checkpoints, list_checkpoints(want_dir)):
        assert sorted(p.name for p in (g / "sharded").iterdir()) == [".metadata", *SHARDS]
        assert_same_checkpoint(g, w)
        for shard in SHARDS:  # bitwise; .metadata differs only in where and when it was saved
            assert (g / "sharded" / shard).read_bytes() == (w / "sharded" / shard).read_bytes(), shard
        got_meta, want_meta = (FileSystemReader(c / "sharded").read_metadata() for c in (g, w))
        assert (got_meta.state_dict_metadata, got_meta.storage_data) == (want_meta.state_dict_metadata,
                                                                         want_meta.storage_data)
    assert not list(checkpoint_root(got_dir).glob(TMP_PREFIX + "*"))


def test_the_step_after_a_background_fsdp2_save_does_not_leak_into_its_shards(tiny, synchronous, tmp_path):
    """Every rank's shard write of step 1 is held until step 2 has updated every weight and
    moment in place (training's collectives running meanwhile): the shards hold step 1."""
    out = tmp_path / "run"
    record = _run(tiny, out, async_write=True, hold=1)
    assert record["ranks"] == [(0, "")] * 2
    (got,) = list_checkpoints(out)
    assert_same_checkpoint(got, list_checkpoints(synchronous[0])[0])
    saved = read_sharded(got, only="model")["model"]
    assert saved.keys() == record["weights"].keys()
    assert all(not torch.equal(saved[k], w) for k, w in record["weights"].items())  # step 2 did change them


def test_a_job_killed_while_writing_resumes_from_the_previous_fsdp2_checkpoint(tiny, synchronous, background,
                                                                                 tmp_path):
    """What a kill -9 during step 3's background write leaves: its .tmp- folder with one shard
    partial and no checksums, and no later step. The same command resumes from step 2, and
    steps 3 and 4 are those of the uninterrupted run: losses, checkpoints, final weights."""
    (want_dir, want), (got_dir, _) = synchronous, background
    out = tmp_path / "run"
    shutil.copytree(got_dir, out)
    root = checkpoint_root(out)
    shutil.rmtree(root / "step_00000004")
    partial = root / (TMP_PREFIX + "step_00000003")
    (root / "step_00000003").rename(partial)
    (partial / CHECKSUMS_FILE).unlink()
    shard = partial / "sharded" / SHARDS[1]
    shard.write_bytes(shard.read_bytes()[:100])
    resumed = _run(tiny, out, async_write=True)
    assert resumed["ranks"] == [(0, "")] * 2
    assert _losses(resumed) == _losses(want)  # steps 1-2 kept from before the kill, 3-4 trained again
    assert not partial.exists()
    for got, w in zip(list_checkpoints(out)[-2:], list_checkpoints(want_dir)[-2:]):
        assert_same_checkpoint(got, w)
    torch.testing.assert_close(resumed["weights"], want["weights"], rtol=0, atol=0)


@pytest.mark.parametrize("async_write", [False, True])
def test_a_shard_that_fails_on_one_rank_ends_the_run_on_every_rank_in_one_line(tiny, tmp_path, async_write):
    """Rank 1's shard of step 2 meets a full disk. Synchronously the save of step 2 fails; in
    the background step 3 has trained by then and its save raises it, before writing. The
    same line on both ranks either way, and step 2 leaves nothing."""
    out = tmp_path / "run"
    record = _run(tiny, out, async_write=async_write, fail_step=2, fail_rank=1)
    line = (f"dflash-train: error: no space left on the disk of '{out / 'checkpoints'}' while writing checkpoint "
            "step_00000002; its partial folder was removed and the last checkpoint, step_00000001, is kept: "
            "free some space and run the same command again")
    assert record["ranks"] == [(2, line)] * 2
    assert [m["step"] for m in record["metrics"]] == ([1, 2, 3] if async_write else [1, 2])
    assert sorted(p.name for p in checkpoint_root(out).iterdir()) == ["step_00000001"]
