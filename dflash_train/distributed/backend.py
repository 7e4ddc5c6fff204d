"""The distributed backend interface. `build_backend` (distributed/build.py, above the
implementations) is the one place that maps a name to a strategy.

A backend owns everything that differs between running on one device, DDP, FSDP2 and
DeepSpeed ZeRO: process-group setup, wrapping the model, gradient accumulation without
redundant communication, clipping, the optimizer/scheduler step, and checkpoints. The
trainer writes one loop against `Backend` and never asks which one it has:

    backend = build_backend(cfg.backend)
    target = backend.prepare_target(target)
    backend.setup(drafter, optimizer_factory, scheduler_factory, clip_grad_norm=1.0,
                  grad_accum_steps=4)
    for micro_step, batch in enumerate(batches):
        loss = loss_fn(backend.model(batch))
        last = (micro_step + 1) % 4 == 0
        backend.backward(loss, sync=last)
        if last:
            grad_norm = backend.step()

Semantics shared by every backend:
  * `backward(loss)` takes the mean loss of one micro-batch and divides it by
    `grad_accum_steps`; gradients are averaged over ranks. The update therefore follows the
    mean over all micro-batches of all ranks: N ranks x A accumulation steps equals one
    process with N*A accumulation steps.
  * Mixed precision (`mixed_precision: bf16`, the default on CUDA) keeps fp32 master
    weights and fp32 optimizer state and computes in bf16 in every backend.
  * `save_state(dir)` writes one of two formats, both keyed by parameter name and read by
    every backend at any world size (a ZeRO-3 run on 8 GPUs resumes as DDP on 2 or on one
    CPU): full, unsharded fp32 tensors written by rank 0 (`STATE_FILES`; single, DDP,
    ZeRO), or FSDP2's sharded one (`SHARDED_DIR`, a torch.distributed.checkpoint folder
    each rank writes its own shards into, resharded on load); both are defined with their
    readers in training/state_files.py. Either is also taken in two halves, for training to
    go on while the files are written (checkpoint.async_write): `stage_state(dir)`
    (collective, quick) copies the state into host memory and returns the call that writes
    it, which each process may run on another thread. The full format's copy is
    `snapshot_state()`, on the main process; FSDP2's is each rank's shards, written by
    torch.distributed.checkpoint's `async_save`.
"""

from __future__ import annotations

import copy
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dflash_train.config import DistributedConfig
from dflash_train.training.state_files import STATE_FILES, write_sharded, write_state

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


def shardable_blocks(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: every element of every nn.ModuleList
    (decoder layers in HF models and in the drafter). Sharding per block lets FSDP2 gather
    one layer at a time instead of the whole model. Also the modules a model lists as
    `modules_called_outside_forward` (DFlash2's candidate selector, which its loss calls
    after the forward): outside the root's forward only their own wrapping gathers them."""
    blocks = [block for child in module.modules() if isinstance(child, nn.ModuleList) for block in child]
    return blocks + list(getattr(module, "modules_called_outside_forward", ()))


def host_copy(tree: Any) -> Any:
    """``tree`` (dicts, lists and tuples of tensors and plain values) with every tensor copied
    into new host memory, which later in-place updates of the originals (the next optimizer
    step) cannot reach. Device tensors are copied into pinned memory without waiting, then
    each device is synchronized once: the copies queue back to back instead of one by one."""
    devices: set[torch.device] = set()

    def copy_of(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: copy_of(v) for key, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(copy_of(v) for v in value)
        if not torch.is_tensor(value):
            return copy.deepcopy(value)
        if value.device.type == "cpu":
            return value.detach().clone()
        devices.add(value.device)
        host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
        return host.copy_(value.detach(), non_blocking=True)

    copied = copy_of(tree)
    for device in devices:
        torch.cuda.synchronize(device)
    return copied


class Backend(ABC):
    """One training strategy. Construct with `build_backend`; call `setup` once."""

    def __init__(self, cfg: DistributedConfig, rank: int, world_size: int, local_rank: int,
                 device: torch.device, mixed_dtype: torch.dtype | None, owns_group: bool):
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.device = device
        # bf16 compute dtype under mixed precision, None for plain fp32
        self.mixed_dtype = mixed_dtype
        self._owns_group = owns_group
        self._model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def model(self) -> nn.Module:
        """The wrapped module to call forward on."""
        if self._model is None:
            raise RuntimeError("Backend.setup(model, ...) must be called before Backend.model")
        return self._model

    @abstractmethod
    def setup(self, model: nn.Module, optimizer_factory: OptimizerFactory,
              scheduler_factory: SchedulerFactory | None, clip_grad_norm: float | None,
              grad_accum_steps: int) -> None:
        """Wraps `model` for the strategy and builds the optimizer from
        `optimizer_factory(trainable_params)` (params of the wrapped model; group them by
        `p.ndim`, not by name) and the scheduler from `scheduler_factory(optimizer)`.
        `clip_grad_norm` None or 0 disables clipping."""

    @abstractmethod
    def backward(self, loss: torch.Tensor, sync: bool) -> None:
        """Accumulates gradients of `loss / grad_accum_steps`; `sync=False` on all but the
        last micro-step of an update skips the gradient communication."""

    @abstractmethod
    def step(self, loss: torch.Tensor | None = None) -> float:
        """Clips, steps optimizer and scheduler, zeroes grads; returns the pre-clip norm.
        A non-finite norm means the update was skipped like `skip_step` does: gradients
        dropped, weights, optimizer state and schedule untouched. ``loss`` (this step's
        reduced loss, on the device) skips it the same way when it is not finite; the
        norm is then NaN."""

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.detach().to(self.device, copy=True)
        if self.world_size > 1:
            dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def save_state(self, directory: str | os.PathLike) -> None:
        """Collective: writes model, optimizer and scheduler state (STATE_FILES or SHARDED_DIR)."""
        snapshot = self.snapshot_state()
        if self.is_main:
            write_state(directory, snapshot)
        self.barrier()

    def stage_state(self, directory: str | os.PathLike) -> Callable[[], None] | None:
        """Collective: `save_state` in two halves. Returns once the state of this moment is
        copied into host memory (the next steps cannot change what is written), with the call
        that writes it into ``directory``, to run on any thread of this process; None where
        this process has nothing left to write. Every process that gets one must run it; on
        the main process it returns only once every process's part is written."""
        snapshot = self.snapshot_state()
        return partial(write_state, directory, snapshot) if self.is_main else None

    def snapshot_state(self) -> dict[str, Any] | None:
        """Collective: the full model, optimizer and scheduler state dicts (STATE_FILES' keys)
        as host copies on the main process, None on the others; `write_state` writes them.
        They hold the state of this moment, whatever the next steps change."""
        model_sd, optim_sd = self._full_state()
        if not self.is_main:
            return None
        scheduler_sd = self.scheduler.state_dict() if self.scheduler is not None else None
        return {"model": model_sd, "optimizer": optim_sd, "scheduler": copy.deepcopy(scheduler_sd)}

    @abstractmethod
    def _full_state(self) -> tuple[dict, dict]:
        """Collective: the full model and optimizer state dicts as new host copies on the
        main process (no tensor shared with the live state); other ranks return what they
        hold, which is dropped."""

    @abstractmethod
    def load_state(self, directory: str | os.PathLike) -> None:
        """Collective: restores what `save_state` wrote, at any world size and backend."""

    @abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective: full fp32 model weights on CPU on rank 0, None on other ranks."""

    def optimizer_settings(self) -> list[dict]:
        """Each param group's hyperparameters as the recipe built them (lr, betas, eps,
        weight decay, the schedule's initial_lr): taken before `load_state` overwrites them."""
        return [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]

    def apply_optimizer_settings(self, groups: list[dict]) -> None:
        """After `load_state` under a changed recipe (resume=force): the recipe's
        hyperparameters replace the checkpoint's, and the schedule keeps its position but
        follows the recipe's peak learning rate and length."""
        for group, fresh in zip(self.optimizer.param_groups, groups, strict=True):
            group.update({k: v for k, v in fresh.items() if k != "lr"})
        s = self.scheduler
        if s is None:
            for group, fresh in zip(self.optimizer.param_groups, groups):
                group["lr"] = fresh["lr"]
            return
        s.base_lrs = [fresh["initial_lr"] for fresh in groups]
        # LambdaLR (every warmup schedule of ours): lr = base * factor(step), recomputed now
        # so the very next step uses the new value, not the checkpoint's.
        lrs = [base * factor(s.last_epoch) for base, factor in zip(s.base_lrs, s.lr_lambdas)]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        s._last_lr = lrs

    def prepare_target(self, module: nn.Module) -> nn.Module:
        """Freezes the target and moves it to the device: replicated, or with each block
        (decoder layer) sharded by FSDP2 when `shard_target` is set. Only the blocks are
        sharded; embeddings, norms and the LM head stay replicated, so the trainer may call
        them directly and may stop the forward after any layer. A sharded block's forward
        all-gathers, so every rank must run the target the same number of times."""
        module.requires_grad_(False).eval()
        if self.cfg.shard_target and self.world_size > 1:
            from torch.distributed.fsdp import fully_shard

            mesh = dist.device_mesh.init_device_mesh(self.device.type, (self.world_size,))
            # FSDP2 moves each block to the device as it shards it: a target that does not
            # fit one GPU never sits there whole.
            for block in reversed(shardable_blocks(module)):  # nested blocks before parents
                fully_shard(block, mesh=mesh)
                # Each block is its own FSDP root (no wrap around the whole target, which
                # the trainer does not always call), and FSDP2 keeps a root's gathered
                # params after forward for the backward that a frozen target never runs.
                block.register_forward_hook(lambda block, args, output: block.reshard())
        return module.to(self.device)

    @abstractmethod
    def skip_step(self) -> None:
        """Drops the accumulated gradients without touching weights, optimizer state or
        the schedule (the loss was not finite). Call it where `step` would go."""

    def shutdown(self) -> None:
        if self._owns_group and dist.is_initialized():
            # Every rank reaches here before any tears the group down: a rank that destroys
            # it while a peer still has gloo work in flight aborts both ("terminate called
            # without an active exception"), seen with ZeRO-2 on CPU.
            dist.barrier()
            dist.destroy_process_group()
            self._owns_group = False

    # The sharded format's files (FSDP2).
    def _write_sharded_state(self, directory: str | os.PathLike, model_sd: dict, optim_sd: dict) -> None:
        """Every rank writes the shards it holds, in parallel; nothing is gathered."""
        write_sharded({"model": model_sd, "optim": optim_sd}, directory)
        self._write_scheduler(directory)

    def _write_scheduler(self, directory: str | os.PathLike) -> None:
        if self.is_main:
            path = Path(directory)
            path.mkdir(parents=True, exist_ok=True)
            scheduler_sd = self.scheduler.state_dict() if self.scheduler is not None else None
            torch.save(scheduler_sd, path / STATE_FILES["scheduler"])
        self.barrier()

    def _load_scheduler(self, scheduler_sd: dict | None) -> None:
        if (scheduler_sd is None) != (self.scheduler is None):
            raise ValueError(f"checkpoint scheduler state is {'absent' if scheduler_sd is None else 'present'}"
                             f" but this run's scheduler is {self.scheduler!r}")
        if self.scheduler is not None:
            self.scheduler.load_state_dict(scheduler_sd)

