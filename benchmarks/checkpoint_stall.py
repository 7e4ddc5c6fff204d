"""How long a checkpoint stops training, written synchronously or in the background
(checkpoint.async_write), for a drafter state of N float32 parameters with AdamW's two moments.

    python -m benchmarks.checkpoint_stall                       # 50M and 150M parameters, CPU
    python -m benchmarks.checkpoint_stall --params 50 150 --repeats 3 --dir /fast/disk

The real save path (`save_checkpoint` on the single backend, whose state is a stack of square
linear layers that took one AdamW step), into a fresh folder each time; the median of
``--repeats`` saves. "stopped" is the time `save_checkpoint` takes to return, which training
waits for; with async_write the files are then written on the writer's thread, whose time
("written after") is measured separately by waiting for it. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from dflash_train.config import TrainConfig
from dflash_train.distributed.build import build_backend
from dflash_train.training.checkpoint import CheckpointWriter, TrainerState, save_checkpoint

WIDTH = 2048  # each layer WIDTH x WIDTH (+ bias): 4.2M parameters


def trained_backend(params_m: int):
    """The single backend on CPU over ~params_m million parameters, after one AdamW step."""
    layers = max(1, round(params_m * 1e6 / (WIDTH * WIDTH + WIDTH)))
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(layers)))
    backend = build_backend({"name": "single", "device": "cpu"})
    backend.setup(model, lambda p: torch.optim.AdamW(p, lr=1e-4), None, clip_grad_norm=None, grad_accum_steps=1)
    for p in backend.model.parameters():
        p.grad = torch.ones_like(p)
    backend.step()
    return backend, sum(p.numel() for p in model.parameters())


def stall_seconds(backend, root: Path, async_write: bool, repeats: int) -> tuple[float, float | None]:
    """Median seconds save_checkpoint takes to return, and (async) the background write's."""
    cfg = TrainConfig(output_dir=str(root))
    stopped, written = [], []
    for step in range(1, repeats + 1):
        out = root / f"{'async' if async_write else 'sync'}-{step}"
        writer = CheckpointWriter() if async_write else None
        started = time.perf_counter()
        save_checkpoint(backend, out, TrainerState(step=step, global_batch=1), cfg, keep_last=1, writer=writer)
        returned = time.perf_counter()
        stopped.append(returned - started)
        if writer is not None:
            writer.wait()
            written.append(time.perf_counter() - returned)
    return statistics.median(stopped), statistics.median(written) if written else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, nargs="+", default=[50, 150], help="millions of parameters")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the checkpoints are written (a temporary folder)")
    args = parser.parse_args()
    rows = ["| parameters | model.pt + optimizer.pt | stopped, async_write=false | stopped, async_write=true "
            "| written after, in the background |", "|---|---|---|---|---|"]
    for params_m in args.params:
        backend, count = trained_backend(params_m)
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            sync, _ = stall_seconds(backend, Path(tmp), async_write=False, repeats=args.repeats)
            stall, written = stall_seconds(backend, Path(tmp), async_write=True, repeats=args.repeats)
        gb = 3 * count * 4 / 1e9  # weights, exp_avg, exp_avg_sq in float32
        rows.append(f"| {count / 1e6:.0f}M | {gb:.2f} GB | {sync:.2f} s | {stall:.2f} s | {written:.2f} s |")
        del backend
    print("\n".join(rows))


if __name__ == "__main__":
    main()
