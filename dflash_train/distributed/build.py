"""`build_backend`: the one place that maps a backend name to its implementation.

It sits above the interface (backend.py) and the implementations (torch_native.py,
deepspeed.py), so that no implementation imports a module that imports it back. It also
joins the process group the launcher set up (distributed/launch.py reads its variables).
"""

from __future__ import annotations

import datetime
import importlib.util
from collections.abc import Iterable

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from dflash_train.config import DistributedConfig
from dflash_train.distributed.backend import Backend
from dflash_train.distributed.launch import LaunchEnv, launch_env
from dflash_train.recipe import to_config

BACKEND_NAMES = ("single", "ddp", "fsdp2", "zero2", "zero3")
DEEPSPEED_BACKENDS = ("zero2", "zero3")


def _as_config(cfg: DistributedConfig | DictConfig | dict | None) -> DistributedConfig:
    if isinstance(cfg, DistributedConfig):
        return cfg
    return to_config(DistributedConfig, cfg or {}, prefix="backend")


def _check_choice(field: str, value: str, choices: Iterable[str]) -> None:
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"backend.{field}={value!r} is not one of {list(choices)}")


def validate_config(cfg: DistributedConfig) -> None:
    """Cross-field checks that need no process group; raises ValueError with the values."""
    _check_choice("name", cfg.name, BACKEND_NAMES)
    _check_choice("dist_backend", cfg.dist_backend, ("auto", "nccl", "gloo"))
    _check_choice("mixed_precision", cfg.mixed_precision, ("auto", "bf16", "none"))
    _check_choice("device", cfg.device, ("auto", "cpu", "cuda"))
    if cfg.device == "cpu" and cfg.dist_backend == "nccl":
        raise ValueError("backend.dist_backend='nccl' needs CUDA but backend.device='cpu'")
    if cfg.cpu_offload and cfg.name not in ("fsdp2", "zero2", "zero3"):
        raise ValueError(f"backend.cpu_offload needs fsdp2, zero2 or zero3, not {cfg.name!r}")
    if cfg.name in DEEPSPEED_BACKENDS and importlib.util.find_spec("deepspeed") is None:
        raise ValueError(f"backend {cfg.name!r} needs deepspeed: pip install 'dflash-train[deepspeed]'")


def resolve_device(cfg: DistributedConfig, local_rank: int) -> torch.device:
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise ValueError("backend.device='cuda' but torch.cuda.is_available() is False")
    if use_cuda:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_process_group(cfg: DistributedConfig, device: torch.device, env: LaunchEnv) -> bool:
    """Joins (or creates) the default process group; True when this call created it."""
    if dist.is_initialized():
        return False
    backend = cfg.dist_backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"backend.dist_backend='nccl' needs a CUDA device, got {device}")
    timeout = datetime.timedelta(minutes=cfg.timeout_minutes)
    if env.world_size == 1 and not env.rendezvous:
        # One process without a launcher: an in-memory store, no port to pick.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        dist.init_process_group(backend, rank=env.rank, world_size=env.world_size, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
    return True


def build_backend(cfg: DistributedConfig | DictConfig | dict | None = None) -> Backend:
    """The backend named by `cfg.name`, with its process group joined."""
    cfg = _as_config(cfg)
    validate_config(cfg)
    env = launch_env()
    if cfg.name == "single" and env.world_size > 1:
        raise ValueError(f"backend 'single' runs one process but WORLD_SIZE={env.world_size}; "
                         f"use one of {list(BACKEND_NAMES[1:])}")
    device = resolve_device(cfg, env.local_rank)
    precision = cfg.mixed_precision
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "none"
    mixed_dtype = torch.bfloat16 if precision == "bf16" else None
    owns_group = cfg.name != "single" and init_process_group(cfg, device, env)
    args = (cfg, env.rank, env.world_size, env.local_rank, device, mixed_dtype, owns_group)
    if cfg.name in DEEPSPEED_BACKENDS:
        from dflash_train.distributed.deepspeed import DeepSpeedBackend  # optional install

        return DeepSpeedBackend(*args)
    from dflash_train.distributed.torch_native import DDPBackend, FSDP2Backend, SingleBackend

    return {"single": SingleBackend, "ddp": DDPBackend, "fsdp2": FSDP2Backend}[cfg.name](*args)
