"""AdamW and the learning-rate schedules, as factories the distributed backend calls.

The backend builds the optimizer after it has wrapped or sharded the model, so the trainer
hands it functions rather than objects.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor
from transformers import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup, get_wsd_schedule

from dflash_train.config import OptimConfig


def param_groups(params: Iterable[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    """Decay matrices only: norm gains (1-D) are scales around 1, pulling them to 0 hurts."""
    params = [p for p in params if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def optimizer_factory(cfg: OptimConfig) -> Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]:
    def build(params):
        groups = param_groups(params, cfg.weight_decay)
        flat = [p for group in groups for p in group["params"]]
        # The fused kernels step every parameter in one pass: on CUDA one launch (25 ms -> a
        # few ms for 1B parameters), on a CPU 3.4x faster than the default for the quickstart's
        # 8M parameters (25 ms of a 200 ms step), equal to it within a float32 ulp. Sharded
        # (DTensor) parameters on a CPU keep the default, which handles them.
        on_cuda = all(p.is_cuda for p in flat)  # DTensors answer for their shards
        plain_cpu = all(p.device.type == "cpu" and not isinstance(p, DTensor) for p in flat)
        fused = True if flat and (on_cuda or plain_cpu) else None
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=fused)

    return build


def warmup_steps(cfg: OptimConfig, total_steps: int) -> int:
    return math.ceil(cfg.warmup_ratio * total_steps)


def scheduler_factory(cfg: OptimConfig, total_steps: int) -> Callable[[torch.optim.Optimizer], object]:
    """Linear warmup over ``warmup_ratio`` of the run, then cosine decay to 0, constant, or
    (wsd) constant until the last ``decay_ratio`` of the run and a 1-sqrt decay to 0."""
    warmup = warmup_steps(cfg, total_steps)

    def build(optimizer):
        if cfg.schedule == "constant":
            return get_constant_schedule_with_warmup(optimizer, warmup)
        if cfg.schedule == "wsd":
            decay = min(math.ceil(cfg.decay_ratio * total_steps), total_steps - warmup)
            return get_wsd_schedule(optimizer, warmup, decay, num_training_steps=total_steps, decay_type="1-sqrt")
        return get_cosine_schedule_with_warmup(optimizer, warmup, total_steps)

    return build
