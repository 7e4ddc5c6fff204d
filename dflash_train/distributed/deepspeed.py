"""DeepSpeed ZeRO-2 / ZeRO-3 backends.

The DeepSpeed config is derived from `setup`'s arguments, not read from a JSON file, so a
recipe cannot disagree with it: ZeRO stage from the backend name, bf16 under mixed
precision, clipping, one micro-batch per call and the accumulation steps. The trainer's
own optimizer and scheduler are handed to DeepSpeed as client objects.

Checkpoints use the full format of the other backends (STATE_FILES, training/state_files.py)
rather than DeepSpeed's sharded one: the fp32 master weights and the optimizer state are gathered
per parameter with DeepSpeed's `safe_get_full_*` API onto rank 0, which alone keeps them
and writes them; loading scatters them back with `safe_set_full_*`. This needs no
conversion step (DeepSpeed's universal checkpoint needs an offline `ds_to_universal` pass)
and lets a ZeRO run resume at another world size or under DDP/FSDP2, and the reverse.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import (
    lazy_init_hp_params_optimizer_state,
    safe_get_full_fp32_param,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)
from torch import nn

from dflash_train.distributed.backend import Backend, OptimizerFactory, SchedulerFactory
from dflash_train.training.state_files import read_state

log = logging.getLogger(__name__)
ZERO_STAGES = {"zero2": 2, "zero3": 3}
# DeepSpeed prints throughput every `steps_per_print` steps; the trainer logs its own.
_NEVER = 2**62


def deepspeed_config(stage: int, world_size: int, grad_accum_steps: int, clip_grad_norm: float | None,
                     bf16: bool, cpu_offload: bool) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}
    if cpu_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        # the trainer's micro-batch is one call of the model, whatever its row count
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": grad_accum_steps,
        "train_batch_size": world_size * grad_accum_steps,
        "gradient_clipping": clip_grad_norm or 0.0,
        "bf16": {"enabled": bf16},
        "zero_optimization": zero,
        # the client optimizer is a plain torch one (AdamW): allowed, and kept under
        # offload instead of being swapped for DeepSpeed's JIT-compiled CPU Adam
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": _NEVER,
    }


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """`value` with its floating-point tensors (also inside lists, tuples, dicts) in `dtype`."""
    if torch.is_tensor(value):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_cast_floats(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    return value


class DeepSpeedBackend(Backend):
    def setup(self, model: nn.Module, optimizer_factory: OptimizerFactory,
              scheduler_factory: SchedulerFactory | None, clip_grad_norm: float | None,
              grad_accum_steps: int) -> None:
        if grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps={grad_accum_steps} must be >= 1")
        self.stage = ZERO_STAGES[self.cfg.name]
        accelerator = get_accelerator().device_name()
        if accelerator != self.device.type:
            raise ValueError(f"backend.device resolved to {self.device} but DeepSpeed chose the {accelerator!r} "
                             f"accelerator; set DS_ACCELERATOR={self.device.type} (DeepSpeed's own variable)")
        self.optimizer = optimizer_factory([p for p in model.parameters() if p.requires_grad])
        # DeepSpeed swaps each group's params for flat fp32 partitions; remember which
        # named parameters every group was built with, for the checkpoint's param_groups.
        names = {id(p): name for name, p in model.named_parameters()}
        self._names_by_group = [[names[id(p)] for p in group["params"]] for group in self.optimizer.param_groups]
        self.scheduler = scheduler_factory(self.optimizer) if scheduler_factory is not None else None
        bf16 = self.mixed_dtype == torch.bfloat16
        config = deepspeed_config(self.stage, self.world_size, grad_accum_steps, clip_grad_norm,
                                  bf16=bf16, cpu_offload=self.cfg.cpu_offload)
        if bf16:
            # DeepSpeed's bf16 module takes bf16 inputs; cast float inputs like FSDP2's
            # MixedPrecisionPolicy does, so callers pass the same tensors to every backend.
            model.register_forward_pre_hook(
                lambda module, args, kwargs: (_cast_floats(args, torch.bfloat16), _cast_floats(kwargs, torch.bfloat16)),
                with_kwargs=True)
        # DeepSpeed steps the client scheduler itself at each accumulation boundary.
        self._engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=self.optimizer, lr_scheduler=self.scheduler, config=config,
            dist_init_required=False)
        self._model = self._engine

    def backward(self, loss: torch.Tensor, sync: bool) -> None:
        # The trainer, not DeepSpeed's micro-step counter, decides where an update ends;
        # the engine divides the loss by gradient_accumulation_steps like the other backends.
        self._engine.set_gradient_accumulation_boundary(sync)
        self._engine.backward(loss)

    def step(self, loss: torch.Tensor | None = None) -> float:
        if loss is not None and not bool(torch.isfinite(loss)):
            self.skip_step()
            return math.nan
        self._engine.step()
        if not self._engine.was_step_applied():
            return math.nan  # DeepSpeed found a non-finite gradient norm and skipped the update
        norm = self._engine.get_global_grad_norm()
        return math.nan if norm is None else float(norm)

    def skip_step(self) -> None:
        # DeepSpeed keeps reduced gradients in its own buffers, which the client
        # optimizer's zero_grad does not clear. Its step finds the non-finite gradient norm
        # and skips the update (weights, moments and scheduler untouched), clearing them.
        self._engine.step()
        if self._engine.was_step_applied():
            log.warning("skip_step: the gradients were finite, so DeepSpeed applied the update")

    def _entries(self) -> list[tuple[str, torch.Tensor]]:
        """(name, parameter or buffer) in state_dict order: the same names torch's
        get_state_dict uses, and the same order on every rank (the gathers are collective)."""
        return list(self._engine.module.state_dict(keep_vars=True).items())

    def _flat_partitions(self) -> list[torch.Tensor]:
        """The flat fp32 partitions that key the client optimizer's state. ZeRO-3 puts
        them into the optimizer's param_groups only while it steps, so ask the engine."""
        zero = self._engine.optimizer
        if self.stage == 3:
            return list(zero.fp32_partitioned_groups_flat)
        return list(zero.single_partition_of_fp32_groups)

    def _link_optimizer_state(self) -> None:
        """Points every ZeRO-2 parameter at its slice of the flat optimizer state, which
        `safe_{get,set}_full_optimizer_state` read and write. DeepSpeed links them once,
        right after stepping the FIRST param group, so the parameters of later groups
        (the trainer's no-decay group) would stay unlinked. ZeRO-3 needs no links."""
        if self.stage != 2:
            return
        zero = self._engine.optimizer
        for params, flat in zip(zero.bit16_groups, zero.single_partition_of_fp32_groups):
            if self.optimizer.state.get(flat):
                lazy_init_hp_params_optimizer_state(params, flat, self.optimizer.state)

    def _gather_full(self, with_optimizer: bool) -> tuple[dict, dict]:
        """Collective: the full fp32 model state dict and optimizer state on rank 0's CPU,
        empty dicts (and the small param_groups) on the other ranks.

        Every rank joins each per-tensor gather (DeepSpeed's `safe_get_full_*` all-reduce
        under ZeRO-2, all-gather under ZeRO-3), so each holds one tensor's full value on its
        device at a time; only rank 0 copies it to the host and keeps it. Keeping all of
        them everywhere would cost every process of a node a full CPU copy of the state.
        What rank 0 keeps shares no memory with the live state (a checkpoint written later,
        on a thread, holds this step's values): the gathers fill new buffers, the rest is cloned."""
        self._link_optimizer_state()
        flat = self._flat_partitions()[0]
        flat_state = self.optimizer.state.get(flat, {})
        # Adam's exp_avg/exp_avg_sq are partitioned like the weights; its `step` is one
        # scalar per flat partition, the same for all of them.
        partitioned = [k for k, v in flat_state.items() if torch.is_tensor(v) and v.shape == flat.shape]
        scalars = {k: v for k, v in flat_state.items() if k not in partitioned}
        keep = self.is_main
        model_sd, optim_state = {}, {}
        for name, tensor in self._entries():
            if isinstance(tensor, nn.Parameter) and tensor.requires_grad:
                full = safe_get_full_fp32_param(tensor)
                if keep:
                    model_sd[name] = full.cpu()
                if with_optimizer and flat_state:
                    moments = {k: safe_get_full_optimizer_state(tensor, k) for k in partitioned}
                    if keep:
                        optim_state[name] = {k: v.cpu() for k, v in moments.items()}
                        optim_state[name].update({k: v.clone() for k, v in scalars.items()})
            else:
                with deepspeed.zero.GatheredParameters([tensor], enabled=self.stage == 3):
                    if keep:
                        model_sd[name] = tensor.detach().cpu().clone()
        groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": names}
                  for group, names in zip(self.optimizer.param_groups, self._names_by_group)]
        return model_sd, {"state": optim_state, "param_groups": groups}

    def _full_state(self) -> tuple[dict, dict]:
        return self._gather_full(with_optimizer=True)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        model_sd, _ = self._gather_full(with_optimizer=False)
        return model_sd if self.is_main else None

    def load_state(self, directory: str | os.PathLike) -> None:
        model_sd, optim_sd, scheduler_sd = read_state(directory)
        entries = dict(self._entries())
        if set(entries) != set(model_sd):
            raise ValueError(f"checkpoint {directory} names {sorted(set(model_sd) ^ set(entries))} "
                             "that this model lacks or lacks names this model has")
        state = optim_sd["state"]
        if state and not self.optimizer.state:
            self._materialize_optimizer_state(next(iter(state.values())))
        self._link_optimizer_state()
        for name, tensor in entries.items():
            value = model_sd[name].to(self.device)
            # the module copy (bf16 under mixed precision; partitioned under ZeRO-3) ...
            with deepspeed.zero.GatheredParameters([tensor], modifier_rank=0, enabled=self.stage == 3):
                tensor.data.copy_(value)
            if isinstance(tensor, nn.Parameter) and tensor.requires_grad:
                # ... and the fp32 master copy the optimizer steps on
                safe_set_full_fp32_param(tensor, value)
                for key, saved in state.get(name, {}).items():
                    if saved.shape == value.shape:
                        safe_set_full_optimizer_state(tensor, saved.to(self.device), key)
        self._load_scalar_state_and_groups(state, optim_sd["param_groups"])
        self._load_scheduler(scheduler_sd)

    def _materialize_optimizer_state(self, template: dict[str, torch.Tensor]) -> None:
        """torch optimizers create their state on the first step; a run resumed before
        any step has none for the per-parameter values to be scattered into."""
        for flat in self._flat_partitions():
            self.optimizer.state[flat] = {
                k: torch.zeros_like(flat) if v.dim() > 0 else v.clone() for k, v in template.items()}

    def _load_scalar_state_and_groups(self, state: dict, param_groups: list[dict]) -> None:
        if state:
            scalars = {k: v for k, v in next(iter(state.values())).items() if v.dim() == 0}
            for flat in self._flat_partitions():
                for key, value in scalars.items():
                    self.optimizer.state[flat][key] = value.clone()
        if len(param_groups) != len(self.optimizer.param_groups):
            raise ValueError(f"checkpoint has {len(param_groups)} optimizer param groups, "
                             f"this optimizer {len(self.optimizer.param_groups)}")
        # lr, initial_lr, betas, ...: the scheduler's state does not restore them
        for group, saved in zip(self.optimizer.param_groups, param_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
