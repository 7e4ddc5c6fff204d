"""How long a checkpoint stops training, written synchronously or in the background
(checkpoint.async_write), for a drafter state of N float32 parameters with AdamW's two moments.

    python -m benchmarks.checkpoint_stall                       # 50M and 150M parameters, CPU
    python -m benchmarks.checkpoint_stall --params 50 150 --repeats 3 --dir /fast/disk
    torchrun --nproc_per_node 2 -m benchmarks.checkpoint_stall --backend fsdp2   # 2 gloo processes

The real save path (`save_checkpoint` on the chosen backend, whose state is a stack of square
linear layers that took one AdamW step), into a fresh folder each time; the median of
``--repeats`` saves. "stopped" is the time `save_checkpoint` takes to return on rank 0, which
training waits for; with async_write the files are then written on the writers' threads, whose
time ("written after") is measured separately by waiting for rank 0's (under FSDP2 it ends once
every rank's shards are written). Rank 0 prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from dflash_train.config import TrainConfig
from dflash_train.distributed.build import build_backend
from dflash_train.training.checkpoint import CheckpointWriter, TrainerState, save_checkpoint

WIDTH = 2048  # each layer WIDTH x WIDTH (+ bias): 4.2M parameters


def trained_backend(params_m: int, name: str):
    """Backend ``name`` on CPU over ~params_m million parameters, after one AdamW step."""
    layers = max(1, round(params_m * 1e6 / (WIDTH * WIDTH + WIDTH)))
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(layers)))
    count = sum(p.numel() for p in model.parameters())
    backend = build_backend({"name": name, "device": "cpu"})
    backend.setup(model, lambda p: torch.optim.AdamW(p, lr=1e-4), None, clip_grad_norm=None, grad_accum_steps=1)
    for p in backend.model.parameters():
        p.grad = torch.ones_like(p)
    backend.step()
    return backend, count


def shared_folder(backend, parent: str | None) -> tuple[tempfile.TemporaryDirectory | None, Path]:
    """A temporary folder rank 0 makes (None elsewhere), and its path on every rank."""
    folder = tempfile.TemporaryDirectory(dir=parent) if backend.is_main else None
    path = [folder.name if folder is not None else None]
    if backend.world_size > 1:
        dist.broadcast_object_list(path, src=0)
    return folder, Path(path[0])


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
    parser.add_argument("--backend", default="single", choices=["single", "ddp", "fsdp2"],
                        help="ddp and fsdp2 under torchrun (gloo on CPU)")
    args = parser.parse_args()
    rows = [f"| backend, processes | parameters | state (weights + AdamW moments) | stopped, async_write=false "
            "| stopped, async_write=true | written after, in the background |", "|---|---|---|---|---|---|"]
    for params_m in args.params:
        backend, count = trained_backend(params_m, args.backend)
        folder, tmp = shared_folder(backend, args.dir)
        sync, _ = stall_seconds(backend, tmp, async_write=False, repeats=args.repeats)
        stall, written = stall_seconds(backend, tmp, async_write=True, repeats=args.repeats)
        backend.barrier()  # every rank is done with the folder before rank 0 removes it
        if folder is not None:
            folder.cleanup()
        gb = 3 * count * 4 / 1e9  # weights, exp_avg, exp_avg_sq in float32
        rows.append(f"| {args.backend}, {backend.world_size} | {count / 1e6:.0f}M | {gb:.2f} GB | {sync:.2f} s "
                    f"| {stall:.2f} s | {written:.2f} s |")
        main_process = backend.is_main
        del backend
    if main_process:
        print("\n".join(rows))
    if dist.is_initialized():  # under torchrun: every rank is done before the group goes
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
