"""The files a backend's `save_state` writes into a checkpoint step, and their readers.

Two formats, both keyed by parameter name and readable at any world size by any backend:
full, unsharded fp32 tensors written by rank 0 (`STATE_FILES`: single, DDP, ZeRO), or
FSDP2's sharded one (`SHARDED_DIR`, a torch.distributed.checkpoint folder each rank writes
its own shards into, resharded on load). The backends (dflash_train/distributed/) write and
read them; `dflash-export` reads the model weights without building a backend.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

# What `save_state` writes into its directory: state dicts of full tensors on CPU.
# The optimizer file uses torch's full-state-dict layout (per-parameter state keyed by the
# parameter's name, param_groups listing names), which is independent of sharding.
STATE_FILES = {"model": "model.pt", "optimizer": "optimizer.pt", "scheduler": "scheduler.pt"}
# The sharded format (FSDP2): model and optimizer state as a torch.distributed.checkpoint
# folder of {"model": ..., "optim": ...} in the same layout, the scheduler in STATE_FILES'.
SHARDED_DIR = "sharded"


def write_state(directory: str | os.PathLike, state: dict[str, Any]) -> None:
    """Writes the full format: ``state`` holds the model, optimizer and scheduler state dicts
    under STATE_FILES' keys (a backend's ``snapshot_state``)."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    for key, name in STATE_FILES.items():
        torch.save(state[key], path / name)


def _failures(err: CheckpointException) -> list[BaseException]:
    """Each failing rank's own exception in DCP's CheckpointException, the lowest rank first."""
    return [exc for _rank, (exc, _trace) in sorted(err.failures.items())]


@contextmanager
def dcp_errors() -> Iterator[None]:
    """A failed DCP write raised as the first failing rank's own exception (an OSError for a
    full disk, on whichever rank it happened), on every rank: DCP's CheckpointException is a
    BaseException, which no error handler catches, and its message is a traceback per rank."""
    try:
        yield
    except CheckpointException as err:
        failures = _failures(err)
        raise (failures[0] if failures else RuntimeError(str(err))) from None


def write_sharded(state: dict, directory: str | os.PathLike) -> None:
    """Collective: writes the sharded format's DCP folder, each rank the shards of ``state``
    ({"model": ..., "optim": ...}) it holds; nothing is gathered."""
    with dcp_errors():
        dcp.save(state, checkpoint_id=Path(directory) / SHARDED_DIR)


def start_sharded_write(state: dict, directory: str | os.PathLike, group: dist.ProcessGroup) -> Callable[[], None]:
    """`write_sharded` on DCP's own thread (``async_save``), every rank calling it. Returns once
    this rank's shards of ``state`` are copied into new host memory, which the next optimizer
    steps cannot reach; the thread's collectives run on ``group``. The call it returns waits
    for the write and raises its error as `write_sharded` does; on the main process it returns
    only once every rank's shards are written and synced (DCP gathers each rank's result
    before it writes .metadata)."""
    # async_save (marked experimental in torch 2.13) stages with its default DefaultStager:
    # a blocking copy of every tensor into new, unpinned host memory, done before it returns.
    written = dcp.async_save(state, checkpoint_id=Path(directory) / SHARDED_DIR, process_group=group)

    def wait() -> None:
        with dcp_errors():
            written.result()

    return wait


def check_files(path: Path, names: Iterable[str]) -> None:
    missing = [name for name in names if not (path / name).exists()]
    if missing:
        raise ValueError(f"backend state {path} lacks {missing}: not written by save_state?")


def read_state(directory: str | os.PathLike) -> tuple[dict, dict, dict | None]:
    """Full model and optimizer state dicts and the scheduler's, from either format."""
    path = Path(directory)
    if is_sharded(path):
        # Every rank reads whole tensors into its own memory: the way for a backend
        # that cannot take DTensor shards (DeepSpeed) to resume an FSDP2 checkpoint.
        state = read_sharded(path)
        return state["model"], state["optim"], read_scheduler(path)
    check_files(path, STATE_FILES.values())
    # mmap: every rank may read the same files without holding a private copy each
    model_sd, optim_sd, scheduler_sd = (
        torch.load(path / STATE_FILES[key], map_location="cpu", mmap=True, weights_only=True)
        for key in ("model", "optimizer", "scheduler"))
    return model_sd, optim_sd, scheduler_sd


def read_scheduler(directory: str | os.PathLike) -> dict | None:
    path = Path(directory)
    check_files(path, [STATE_FILES["scheduler"]])
    return torch.load(path / STATE_FILES["scheduler"], map_location="cpu", weights_only=True)


def is_sharded(directory: str | os.PathLike) -> bool:
    """Whether `directory` holds the sharded (torch.distributed.checkpoint) format."""
    return (Path(directory) / SHARDED_DIR).is_dir()


def load_sharded(state: dict, directory: str | os.PathLike, no_dist: bool = False) -> None:
    """Fills `state` ({"model": ..., "optim": ...}) in place from the sharded format: each
    DTensor reads only its own shard, whatever world size wrote it. Collective unless
    `no_dist`. A damaged or mismatched checkpoint raises RuntimeError with DCP's reason."""
    path = Path(directory) / SHARDED_DIR
    check_files(path, [".metadata"])
    with warnings.catch_warnings():
        # DCP warns that it assumes one process when no group exists: that is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(state, checkpoint_id=path, no_dist=no_dist or not dist.is_initialized())
        except CheckpointException as err:  # a BaseException: it would bypass error handling
            causes = [f"{type(e).__name__}: {e}" for e in _failures(err)]
            raise RuntimeError(causes[0] if causes else str(err)) from None


def read_sharded(directory: str | os.PathLike, only: str | None = None) -> dict:
    """The whole state of a sharded checkpoint (or its `only` section, "model" or "optim") as
    plain full tensors in this process, without a process group: for DeepSpeed and export."""
    path = Path(directory) / SHARDED_DIR
    check_files(path, [".metadata"])
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
    check_files(path, [STATE_FILES["model"]])
    return torch.load(path / STATE_FILES["model"], map_location="cpu", weights_only=True)
