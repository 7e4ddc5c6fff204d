"""The real trainer on FSDP2 checkpointing every step, synchronously or in the background
(checkpoint.async_write), under torchrun: the worker of test_fsdp2_async_checkpoint.

Faults and delays are injected where DCP opens a shard file (its FileSystem.create_stream),
on DCP's writing thread: ``fail_step`` makes one rank's shard of that checkpoint hit a full
disk; ``hold`` runs two steps by hand and keeps the first checkpoint's shards unwritten until
the second step has updated every weight in place. Rank 0 saves the per-step metrics, the
final weights and every rank's error line (what dflash-train prints, and its exit status).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import io
import json
import os
import threading
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.filesystem as dcp_filesystem

from dflash_train.errors import run_command
from dflash_train.training.logging import METRICS_FILE
from dflash_train.training.trainer import Trainer
from tests.distributed._backend_worker import exit_now
from tests.train_data import tiny_train_config

HOLD_S = 120  # a write held longer than this fails the test instead of hanging it


def _config(target: str, data: str, output_dir: Path, async_write: bool, max_steps: int):
    return tiny_train_config(target, Path(data), output_dir, max_steps=max_steps,
                             backend={"name": "fsdp2", "device": "cpu"},
                             optim={"micro_batch_size": 1, "grad_accum_steps": 2},
                             checkpoint={"every": 1, "keep_last": max_steps, "async_write": async_write})


def _on_shard_open(action) -> None:
    """Calls ``action(path)`` each time DCP opens a shard file for writing, then opens it."""
    real = dcp_filesystem.FileSystem.create_stream

    def create_stream(self, path, mode):
        if str(path).endswith(".distcp"):
            action(Path(path))
        return real(self, path, mode)

    dcp_filesystem.FileSystem.create_stream = create_stream


def _fail_shard(step: int, rank: int) -> None:
    """This process's shard of checkpoint ``step`` meets a full disk after 100 bytes."""
    def fail(path: Path) -> None:
        if f".tmp-step_{step:08d}" in str(path) and int(os.environ["RANK"]) == rank:
            path.write_bytes(b"\0" * 100)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    _on_shard_open(fail)


def fit(trainer: Trainer) -> tuple[int, str]:
    """``trainer.fit()`` as dflash-train runs it: its exit status (0, or 2 for a user error)
    and the error line it printed."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            run_command("dflash-train", trainer.fit)
        except SystemExit as stop:
            return stop.code, err.getvalue().strip()
    return 0, err.getvalue().strip()


def held(trainer: Trainer) -> tuple[int, str]:
    """Step 1, its checkpoint, then step 2 while DCP's thread of every rank waits to open its
    shard file of step 1; the write is released once step 2 has updated the weights. Returns
    as ``fit`` does."""
    reached, release = threading.Event(), threading.Event()

    def hold(path: Path) -> None:
        reached.set()
        assert release.wait(HOLD_S), "the worker never released the write"

    _on_shard_open(hold)
    trainer.train_step(0)
    trainer.state.step = 1
    trainer.save()
    assert reached.wait(HOLD_S), "DCP's thread never opened a shard file"
    trainer.train_step(1)  # while every rank's write of step 1 waits
    release.set()
    trainer.finish_checkpoint()
    return 0, ""


def run(target: str, data: str, output_dir: Path, async_write: bool, max_steps: int, fail_step: int = 0,
        fail_rank: int = 0, hold: bool = False) -> dict | None:
    if fail_step:
        _fail_shard(fail_step, fail_rank)
    trainer = Trainer(_config(target, data, output_dir, async_write, max_steps))
    try:
        status, error = held(trainer) if hold else fit(trainer)
        every = [None] * trainer.backend.world_size  # each rank's (status, error line)
        dist.all_gather_object(every, (status, error))
        weights = trainer.backend.full_state_dict()
    finally:
        trainer.backend.shutdown()
    if not trainer.backend.is_main:
        return None
    lines = (output_dir / METRICS_FILE).read_text().splitlines() if (output_dir / METRICS_FILE).exists() else []
    return {"ranks": every, "metrics": [json.loads(line) for line in lines], "weights": weights}


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("out", "target", "data", "output_dir"):
        parser.add_argument(f"--{name}", required=True)
    for name in ("async_write", "max_steps", "fail_step", "fail_rank", "hold"):
        parser.add_argument(f"--{name}", type=int, default=0)
    args = vars(parser.parse_args())
    out = args.pop("out")
    record = run(**{**args, "output_dir": Path(args["output_dir"]), "async_write": bool(args["async_write"]),
                    "hold": bool(args["hold"])})
    if record is not None:
        torch.save(record, out)
    exit_now()


if __name__ == "__main__":
    main()
