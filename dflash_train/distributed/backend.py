"""The distributed backend interface and `build_backend`, the one place that maps a name to
a strategy.

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
    each rank writes its own shards into, resharded on load).
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dflash_train.config import BackendConfig
from dflash_train.recipe import to_config

BACKEND_NAMES = ("single", "ddp", "fsdp2", "zero2", "zero3")
DEEPSPEED_BACKENDS = ("zero2", "zero3")
# What `save_state` writes into its directory: state dicts of full tensors on CPU.
# The optimizer file uses torch's full-state-dict layout (per-parameter state keyed by the
# parameter's name, param_groups listing names), which is independent of sharding.
STATE_FILES = {"model": "model.pt", "optimizer": "optimizer.pt", "scheduler": "scheduler.pt"}
# The sharded format (FSDP2): model and optimizer state as a torch.distributed.checkpoint
# folder of {"model": ..., "optim": ...} in the same layout, the scheduler in STATE_FILES'.
SHARDED_DIR = "sharded"

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


def _as_config(cfg: BackendConfig | DictConfig | dict | None) -> BackendConfig:
    if isinstance(cfg, BackendConfig):
        return cfg
    return to_config(BackendConfig, cfg or {}, prefix="backend")


def _check_choice(field: str, value: str, choices: Iterable[str]) -> None:
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"backend.{field}={value!r} is not one of {list(choices)}")


def validate_config(cfg: BackendConfig) -> None:
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


def _launch_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from the variables torchrun/deepspeed/srun wrappers set."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
            int(os.environ.get("LOCAL_RANK", 0)))


def resolve_device(cfg: BackendConfig, local_rank: int) -> torch.device:
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise ValueError("backend.device='cuda' but torch.cuda.is_available() is False")
    if use_cuda:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_process_group(cfg: BackendConfig, device: torch.device, rank: int, world_size: int) -> bool:
    """Joins (or creates) the default process group; True when this call created it."""
    if dist.is_initialized():
        return False
    backend = cfg.dist_backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"backend.dist_backend='nccl' needs a CUDA device, got {device}")
    timeout = datetime.timedelta(minutes=cfg.timeout_minutes)
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        # One process without a launcher: an in-memory store, no port to pick.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
    return True


def shardable_blocks(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: every element of every nn.ModuleList
    (decoder layers in HF models and in the drafter). Sharding per block lets FSDP2 gather
    one layer at a time instead of the whole model."""
    return [block for child in module.modules() if isinstance(child, nn.ModuleList) for block in child]


class Backend(ABC):
    """One training strategy. Construct with `build_backend`; call `setup` once."""

    def __init__(self, cfg: BackendConfig, rank: int, world_size: int, local_rank: int,
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

    @abstractmethod
    def save_state(self, directory: str | os.PathLike) -> None:
        """Collective: writes model, optimizer and scheduler state (STATE_FILES or SHARDED_DIR)."""

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

    # Checkpoint files, shared by every backend.
    def _write_state(self, directory: str | os.PathLike, model_sd: dict, optim_sd: dict) -> None:
        """Rank 0 writes the full state dicts (the caller gathered them; other ranks pass
        whatever they hold, which is not written)."""
        if self.is_main:
            path = Path(directory)
            path.mkdir(parents=True, exist_ok=True)
            torch.save(model_sd, path / STATE_FILES["model"])
            torch.save(optim_sd, path / STATE_FILES["optimizer"])
        self._write_scheduler(directory)

    def _write_sharded_state(self, directory: str | os.PathLike, model_sd: dict, optim_sd: dict) -> None:
        """Every rank writes the shards it holds, in parallel; nothing is gathered."""
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=Path(directory) / SHARDED_DIR)
        self._write_scheduler(directory)

    def _write_scheduler(self, directory: str | os.PathLike) -> None:
        if self.is_main:
            path = Path(directory)
            path.mkdir(parents=True, exist_ok=True)
            scheduler_sd = self.scheduler.state_dict() if self.scheduler is not None else None
            torch.save(scheduler_sd, path / STATE_FILES["scheduler"])
        self.barrier()

    @staticmethod
    def _read_state(directory: str | os.PathLike) -> tuple[dict, dict, dict | None]:
        """Full model and optimizer state dicts and the scheduler's, from either format."""
        path = Path(directory)
        if is_sharded(path):
            # Every rank reads whole tensors into its own memory: the way for a backend
            # that cannot take DTensor shards (DeepSpeed) to resume an FSDP2 checkpoint.
            state = read_sharded(path)
            return state["model"], state["optim"], read_scheduler(path)
        _check_files(path, STATE_FILES.values())
        # mmap: every rank may read the same files without holding a private copy each
        model_sd, optim_sd, scheduler_sd = (
            torch.load(path / STATE_FILES[key], map_location="cpu", mmap=True, weights_only=True)
            for key in ("model", "optimizer", "scheduler"))
        return model_sd, optim_sd, scheduler_sd

    def _load_scheduler(self, scheduler_sd: dict | None) -> None:
        if (scheduler_sd is None) != (self.scheduler is None):
            raise ValueError(f"checkpoint scheduler state is {'absent' if scheduler_sd is None else 'present'}"
                             f" but this run's scheduler is {self.scheduler!r}")
        if self.scheduler is not None:
            self.scheduler.load_state_dict(scheduler_sd)


def _check_files(path: Path, names: Iterable[str]) -> None:
    missing = [name for name in names if not (path / name).exists()]
    if missing:
        raise ValueError(f"backend state {path} lacks {missing}: not written by save_state?")


def read_scheduler(directory: str | os.PathLike) -> dict | None:
    path = Path(directory)
    _check_files(path, [STATE_FILES["scheduler"]])
    return torch.load(path / STATE_FILES["scheduler"], map_location="cpu", weights_only=True)


def is_sharded(directory: str | os.PathLike) -> bool:
    """Whether `directory` holds the sharded (torch.distributed.checkpoint) format."""
    return (Path(directory) / SHARDED_DIR).is_dir()


def load_sharded(state: dict, directory: str | os.PathLike, no_dist: bool = False) -> None:
    """Fills `state` ({"model": ..., "optim": ...}) in place from the sharded format: each
    DTensor reads only its own shard, whatever world size wrote it. Collective unless
    `no_dist`. A damaged or mismatched checkpoint raises RuntimeError with DCP's reason."""
    path = Path(directory) / SHARDED_DIR
    _check_files(path, [".metadata"])
    with warnings.catch_warnings():
        # DCP warns that it assumes one process when no group exists: that is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(state, checkpoint_id=path, no_dist=no_dist or not dist.is_initialized())
        except CheckpointException as err:  # a BaseException: it would bypass error handling
            causes = [f"{type(e).__name__}: {e}" for e, _ in err.failures.values()]
            raise RuntimeError(causes[0] if causes else str(err)) from None


def read_sharded(directory: str | os.PathLike, only: str | None = None) -> dict:
    """The whole state of a sharded checkpoint (or its `only` section, "model" or "optim") as
    plain full tensors in this process, without a process group: for DeepSpeed and export."""
    path = Path(directory) / SHARDED_DIR
    _check_files(path, [".metadata"])
    metadata = dcp.FileSystemReader(path).read_metadata()
    state: dict = {}
    for key, meta in metadata.state_dict_metadata.items():
        route = metadata.planner_data[key]  # e.g. ("optim", "state", "head.weight", "exp_avg")
        if only is not None and route[0] != only:
            continue
        node = state
        for part in route[:-1]:
            node = node.setdefault(str(part), {})
        # tensors are read into these; pickled values (param_groups) replace the None
        is_tensor = isinstance(meta, TensorStorageMetadata)
        node[str(route[-1])] = torch.empty(meta.size, dtype=meta.properties.dtype) if is_tensor else None
    load_sharded(state, directory, no_dist=True)
    return _as_lists(state)


def _as_lists(tree: Any) -> Any:
    """Dicts keyed "0" ... "n-1" back to the lists they were flattened from (param_groups)."""
    if not isinstance(tree, dict):
        return tree
    tree = {key: _as_lists(value) for key, value in tree.items()}
    indices = [str(i) for i in range(len(tree))]
    if tree and set(tree) == set(indices):
        return [tree[i] for i in indices]
    return tree


def read_model_state(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The full fp32 model state dict a checkpoint holds, in either format, on CPU."""
    path = Path(directory)
    if is_sharded(path):
        return read_sharded(path, only="model").get("model", {})
    _check_files(path, [STATE_FILES["model"]])
    return torch.load(path / STATE_FILES["model"], map_location="cpu", weights_only=True)


def build_backend(cfg: BackendConfig | DictConfig | dict | None = None) -> Backend:
    """The backend named by `cfg.name`, with its process group joined."""
    cfg = _as_config(cfg)
    validate_config(cfg)
    rank, world_size, local_rank = _launch_env()
    if cfg.name == "single" and world_size > 1:
        raise ValueError(f"backend 'single' runs one process but WORLD_SIZE={world_size}; "
                         f"use one of {list(BACKEND_NAMES[1:])}")
    device = resolve_device(cfg, local_rank)
    precision = cfg.mixed_precision
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "none"
    mixed_dtype = torch.bfloat16 if precision == "bf16" else None
    owns_group = cfg.name != "single" and init_process_group(cfg, device, rank, world_size)
    args = (cfg, rank, world_size, local_rank, device, mixed_dtype, owns_group)
    if cfg.name in DEEPSPEED_BACKENDS:
        from dflash_train.distributed.deepspeed import DeepSpeedBackend

        return DeepSpeedBackend(*args)
    from dflash_train.distributed.torch_native import DDPBackend, FSDP2Backend, SingleBackend

    return {"single": SingleBackend, "ddp": DDPBackend, "fsdp2": FSDP2Backend}[cfg.name](*args)
