"""Two checkpoints of the same step hold the same state, value for value, in either format:
what the background-write tests compare a checkpoint written on a thread with."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dflash_train.training.checkpoint import STATE_FILE, checkpoint_problem
from dflash_train.training.state_files import is_sharded, read_sharded


def assert_same_tree(got, want, where: str) -> None:
    """Nested dicts, lists and tuples of tensors and plain values, equal exactly (dtype, shape, values)."""
    if torch.is_tensor(want):
        assert torch.is_tensor(got) and got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got, want), f"{where} differs"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for key in want:
            assert_same_tree(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_tree(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


def assert_same_checkpoint(got: Path, want: Path) -> None:
    """Checkpoint ``got`` passes its checksums and holds what ``want`` (the same step of another
    run) holds: every .pt file (the full format's state, the scheduler, each rank's RNG), FSDP2's
    shards read back whole, and the trainer state. Not config.yaml, which records how the run
    wrote its checkpoints, nor checksums.json, which hashes it."""
    assert got.name == want.name and checkpoint_problem(got) is None
    names = sorted(p.name for p in want.glob("*.pt"))
    assert names and sorted(p.name for p in got.glob("*.pt")) == names
    for name in names:
        assert_same_tree(torch.load(got / name, weights_only=True), torch.load(want / name, weights_only=True),
                         f"{got.name}/{name}")
    assert is_sharded(got) == is_sharded(want), got
    if is_sharded(want):
        assert_same_tree(read_sharded(got), read_sharded(want), f"{got.name}/sharded")
    assert json.loads((got / STATE_FILE).read_text()) == json.loads((want / STATE_FILE).read_text())
