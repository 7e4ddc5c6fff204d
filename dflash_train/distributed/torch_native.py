"""PyTorch-native backends: one process (`single`), DDP and FSDP2.

They share the step (torch clip + optimizer + scheduler) and the checkpoint code: torch's
`get_state_dict`/`set_state_dict` key plain, DDP-wrapped and FSDP2-sharded models alike by
the unwrapped parameter names, which is what makes a checkpoint portable across backends
and world sizes. Single and DDP write full tensors from rank 0; FSDP2 writes its shards
through torch.distributed.checkpoint, every rank its own, so a periodic checkpoint gathers
nothing (the export at the end of a run still gathers the weights, to rank 0's CPU).
Each of them loads both formats.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from dflash_train.distributed.backend import Backend, OptimizerFactory, SchedulerFactory, host_copy, shardable_blocks
from dflash_train.training.state_files import is_sharded, load_sharded, read_scheduler, read_state, start_sharded_write

# Gathers full tensors to rank 0 on CPU: the GPU never holds the whole unsharded state.
_FULL_TO_CPU = StateDictOptions(full_state_dict=True, cpu_offload=True)
# Full state dicts on their device: a replicated model's are its live tensors (`host_copy`
# copies them for a checkpoint); on load, every rank passes the full state dict it read
# (memory-mapped) and each keeps its own shard.
_FULL = StateDictOptions(full_state_dict=True)


class _TorchBackend(Backend):
    """Shared by single, DDP and FSDP2; subclasses wrap the model and control grad sync."""

    def setup(self, model: nn.Module, optimizer_factory: OptimizerFactory,
              scheduler_factory: SchedulerFactory | None, clip_grad_norm: float | None,
              grad_accum_steps: int) -> None:
        if grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps={grad_accum_steps} must be >= 1")
        self.grad_accum_steps = grad_accum_steps
        self.clip_grad_norm = clip_grad_norm or math.inf
        self._model = self._wrap(model)
        self._params = [p for p in self._model.parameters() if p.requires_grad]
        self.optimizer = optimizer_factory(self._params)
        self.scheduler = scheduler_factory(self.optimizer) if scheduler_factory is not None else None
        # A fused CUDA AdamW over plain tensors divides the gradients by the ``grad_scale`` it
        # reads from itself, inside its one kernel: clipping then costs no pass of its own over
        # the gradients (1B fp32 gradients: 8 GB of traffic, ~3 ms an H100). DTensor shards and
        # other optimizers clip.
        self._clip_in_step = (self.device.type == "cuda" and bool(self.optimizer.defaults.get("fused"))
                              and not any(isinstance(p, DTensor) for p in self._params))

    def _wrap(self, model: nn.Module) -> nn.Module:
        return _compute_in(model.to(self.device), self.mixed_dtype)

    def backward(self, loss: torch.Tensor, sync: bool) -> None:
        (loss / self.grad_accum_steps).backward()

    def step(self, loss: torch.Tensor | None = None) -> float:
        if self._clip_in_step:
            return self._fused_step(loss)
        norm = self._clip(loss)
        if not math.isfinite(norm):
            self.skip_step()  # an inf/NaN gradient would poison weights and Adam moments
            return norm
        self.optimizer.step()
        return self._after_update(norm)

    def _clip(self, loss: torch.Tensor | None) -> float:
        """The gradients clipped to clip_grad_norm; returns their global norm (the same on
        every rank), NaN for a non-finite loss (the step is then skipped, gradients unclipped)."""
        if loss is not None and not bool(torch.isfinite(loss)):
            return math.nan
        # max_norm=inf when clipping is off still returns the norm and scales by exactly 1
        norm = torch.nn.utils.clip_grad_norm_(self._params, self.clip_grad_norm)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm)

    def _fused_step(self, loss: torch.Tensor | None) -> float:
        """The fused AdamW step, queued without waiting for the device: the kernel divides
        the gradients by ``grad_scale`` (the clip) and skips the whole update when
        ``found_inf`` is set (a non-finite norm or loss; its step counters stay as they
        were). Only the norm comes back to the host, copied before the update in the
        stream, so the host returns to launching the next step while the update runs."""
        total = torch.nn.utils.get_total_norm([p.grad for p in self._params if p.grad is not None]).float()
        ok = torch.isfinite(total) if loss is None else torch.isfinite(total) & torch.isfinite(loss)
        # Dividing by max(1, norm / max_norm) is clip_grad_norm_'s min(1, max_norm / norm).
        self.optimizer.grad_scale = (total / self.clip_grad_norm).clamp(min=1.0)
        self.optimizer.found_inf = (~ok).float()
        report = torch.where(ok, total, torch.full_like(total, math.nan))
        host = torch.empty((), dtype=torch.float32, pin_memory=True)
        host.copy_(report, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        self.optimizer.step()
        copied.synchronize()
        norm = float(host)
        if not math.isfinite(norm):
            self.skip_step()  # the kernel left weights and moments alone; drop the gradients
            return norm
        return self._after_update(norm)

    def _after_update(self, norm: float) -> float:
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def skip_step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _full_state(self) -> tuple[dict, dict]:
        # cpu_offload would return the live tensors themselves on the CPU (and pageable,
        # blocking copies on a GPU): host_copy makes the one copy, pinned on a GPU.
        model_sd, optim_sd = get_state_dict(self._model, self.optimizer, options=_FULL)
        return (host_copy(model_sd), host_copy(optim_sd)) if self.is_main else ({}, {})

    def load_state(self, directory: str | os.PathLike) -> None:
        if is_sharded(directory):
            self._load_sharded(directory)
            return
        model_sd, optim_sd, scheduler_sd = read_state(directory)
        set_state_dict(self._model, self.optimizer, model_state_dict=model_sd,
                       optim_state_dict=optim_sd, options=_FULL)
        self._load_scheduler(scheduler_sd)

    def _load_sharded(self, directory: str | os.PathLike) -> None:
        # This run's own layout (DTensor shards under FSDP2, plain tensors otherwise) says
        # what each rank reads; get_state_dict first creates the optimizer state of a
        # run that has not stepped yet, for the saved state to be read into.
        model_sd, optim_sd = get_state_dict(self._model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        load_sharded(state, directory)
        set_state_dict(self._model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self._load_scheduler(read_scheduler(directory))

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        state = get_model_state_dict(self._model, options=_FULL_TO_CPU)
        return state if self.is_main else None


def _compute_in(model: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    """bf16 compute over fp32 master weights via autocast, the single/DDP counterpart of
    FSDP2's MixedPrecisionPolicy and DeepSpeed's bf16 mode. Patching `forward` on the
    instance keeps parameter names (and so checkpoints) unchanged."""
    if dtype is not None:
        device_type = next(model.parameters()).device.type
        model.forward = torch.autocast(device_type, dtype=dtype)(model.forward)
    return model


class SingleBackend(_TorchBackend):
    """One process, no torch.distributed; the checkpoint helpers work without a group."""


class DDPBackend(_TorchBackend):
    """Replicated model; gradients all-reduced once per update.

    DDP decides whether a backward all-reduces when the FORWARD runs, but the interface
    learns `sync` only at backward time. So the backend arms the next forward from its own
    micro-step count, and if an update ends earlier than `grad_accum_steps` (a short last
    window) it all-reduces by hand. An extra all-reduce mid-window would be harmless:
    averaging is linear, so averaged and local gradients still sum to the same mean.
    """

    def _wrap(self, model: nn.Module) -> nn.Module:
        model = super()._wrap(model)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=device_ids)
        self._micro_step = 0
        ddp.require_backward_grad_sync = self.grad_accum_steps == 1
        return ddp

    def backward(self, loss: torch.Tensor, sync: bool) -> None:
        reduced_in_backward = self._model.require_backward_grad_sync
        super().backward(loss, sync)
        if sync and not reduced_in_backward:
            self._average_grads_by_hand()
        self._micro_step = 0 if sync else self._micro_step + 1
        self._model.require_backward_grad_sync = self._micro_step == self.grad_accum_steps - 1

    def _average_grads_by_hand(self) -> None:
        for param in self._params:
            if param.grad is not None:
                dist.all_reduce(param.grad)
                param.grad.div_(self.world_size)


class FSDP2Backend(_TorchBackend):
    """Parameters, gradients and optimizer state sharded per block (`fully_shard`).

    Every rank writes its own shards of a checkpoint (torch.distributed.checkpoint). In the
    background (`stage_state`) DCP's `async_save` copies them into host memory and writes
    them on a thread of its own, whose collectives (the plan, and the gather of every rank's
    result that tells the main process all shards are written) run on a process group of
    their own (`_checkpoint_group`)."""

    def _wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        self._checkpoint_pg: dist.ProcessGroup | None = None
        mesh = dist.device_mesh.init_device_mesh(self.device.type, (self.world_size,))
        # fp32 gradient reduction even under bf16 compute: summing bf16 grads over many
        # ranks loses precision
        precision = MixedPrecisionPolicy(param_dtype=self.mixed_dtype, reduce_dtype=torch.float32)
        offload = CPUOffloadPolicy() if self.cfg.cpu_offload else OffloadPolicy()
        if not self.cfg.cpu_offload:
            model = model.to(self.device)
        options = dict(mesh=mesh, mp_policy=precision, offload_policy=offload)
        for block in shardable_blocks(model):
            fully_shard(block, reshard_after_forward=self.cfg.reshard_after_forward, **options)
        # The root's parameters (the drafter's input projection and norms) stay gathered from
        # forward to backward: its final norm is the first thing the backward needs, so
        # resharding it would all-gather it again at once, the first collective of the backward
        # with nothing to hide it behind. torch's own default for a root, which an explicit
        # reshard_after_forward=True passed to it would turn off.
        return fully_shard(model, reshard_after_forward=False, **options)

    def _clip(self, loss: torch.Tensor | None) -> float:
        """The clip from this rank's shards, read by the host once: the sum of the squares of
        its gradient shards, all-reduced (one scalar), is the global norm. torch's
        clip_grad_norm_ over DTensors all-reduces every parameter's partial norm through
        DTensor's dispatch, and the loss's check and the norm were two host syncs before the
        optimizer step could be queued. CPU offload keeps the default (its gradients live in
        host memory, which an NCCL all-reduce cannot read)."""
        if self.cfg.cpu_offload:
            return super()._clip(loss)
        shards = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                  for p in self._params if p.grad is not None]
        # (): this rank's part (on the device even with no gradient here, for the all-reduce)
        squares = torch.nn.utils.get_total_norm(shards).to(self.device, torch.float64).square()
        if self.world_size > 1:
            dist.all_reduce(squares)
        total = squares.sqrt()
        if loss is not None:  # a non-finite loss skips the update as a non-finite norm does
            total = torch.where(torch.isfinite(loss), total, torch.full_like(total, math.nan))
        norm = float(total)  # the one host sync: the same value on every rank
        coef = self.clip_grad_norm / (norm + 1e-6)  # clip_grad_norm_'s coefficient and epsilon
        if math.isfinite(norm) and coef < 1.0:
            torch._foreach_mul_(shards, coef)
        return norm

    def save_state(self, directory: str | os.PathLike) -> None:
        self._write_sharded_state(directory, *get_state_dict(self._model, self.optimizer))

    def stage_state(self, directory: str | os.PathLike) -> Callable[[], None]:
        model_sd, optim_sd = get_state_dict(self._model, self.optimizer)
        wait = start_sharded_write({"model": model_sd, "optim": optim_sd}, directory, self._checkpoint_group())
        self._write_scheduler(directory)  # a few numbers: written now, beside the RNG files
        return wait

    def _checkpoint_group(self) -> dist.ProcessGroup:
        """The process group of the background writes' collectives, made at the first one.

        Not the default group: collectives of one group must come in the same order on every
        rank, and DCP's thread issues its own while the training thread issues FSDP2's
        all-gathers and reduce-scatters; on a shared group they would pair up across ranks in
        whatever order the two threads happen to reach them, and hang or mix their data
        (seen: on the default group, 2 gloo processes hung at their first background write).
        gloo: DCP exchanges pickled plans between host memories (async_save refuses a group
        without a CPU backend), and on GPUs training keeps NCCL to itself. Every rank creates
        it at the same point, the first `stage_state` (collective); a run that writes its
        checkpoints synchronously never does."""
        if self._checkpoint_pg is None:
            self._checkpoint_pg = dist.new_group(backend="gloo")
        return self._checkpoint_pg

    def backward(self, loss: torch.Tensor, sync: bool) -> None:
        # FSDP2 reads this flag in its post-backward hooks, so setting it here is in time
        self._model.set_requires_gradient_sync(sync)
        super().backward(loss, sync)
