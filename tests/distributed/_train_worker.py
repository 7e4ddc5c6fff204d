"""The real trainer (`Trainer(cfg).fit()`) on the tiny random target, one backend, under
torchrun: the worker of test_train_parity. Rank 0 saves the per-step metrics and the
final drafter weights."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dflash_train.training.logging import METRICS_FILE
from dflash_train.training.trainer import Trainer
from tests.distributed._backend_worker import exit_now, skip_deepspeed_shm_op
from tests.train_data import tiny_train_config


def run(target: str, data: str, output_dir: Path, backend: str, micro_batch_size: int, grad_accum_steps: int,
        max_steps: int, val_rows: int = 0, kind: str = "dflash") -> dict | None:
    """Trains (resuming from output_dir's latest checkpoint, if any) up to max_steps; ``kind``:
    drafter.kind (dflash2 with a small selector whose top-K covers some gold tokens)."""
    drafter = {"kind": kind, "dflash2": {"selector_rank": 8, "selector_top_k": 2048}}
    cfg = tiny_train_config(target, Path(data), output_dir, max_steps=max_steps, drafter=drafter,
                            backend={"name": backend, "device": "cpu"}, data={"val_rows": val_rows},
                            optim={"micro_batch_size": micro_batch_size, "grad_accum_steps": grad_accum_steps})
    trainer = Trainer(cfg)
    try:
        trainer.fit()
        weights = trainer.backend.full_state_dict()
    finally:
        trainer.backend.shutdown()
    if not trainer.backend.is_main:
        return None
    metrics = [json.loads(line) for line in (output_dir / METRICS_FILE).read_text().splitlines()]
    return {"metrics": metrics, "weights": weights}


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("out", "target", "data", "output_dir", "backend"):
        parser.add_argument(f"--{name}", required=True)
    for name in ("micro_batch_size", "grad_accum_steps", "max_steps"):
        parser.add_argument(f"--{name}", type=int, required=True)
    parser.add_argument("--val_rows", type=int, default=0)
    parser.add_argument("--kind", default="dflash")
    args = vars(parser.parse_args())
    out = args.pop("out")
    skip_deepspeed_shm_op()
    record = run(**{**args, "output_dir": Path(args["output_dir"])})
    if record is not None:
        torch.save(record, out)
    exit_now()


if __name__ == "__main__":
    main()
