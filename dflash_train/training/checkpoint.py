"""Training checkpoints: full state, written atomically, the last N kept, resumed from the latest.

Layout under ``<output_dir>/checkpoints/``::

    step_00000120/
        model.pt optimizer.pt scheduler.pt   the backend's world-size-independent state
        trainer_state.json                   step, samples seen, counters, global batch
        config.yaml                          the resolved recipe of the run
        rng_rank{r}.pt                       each process's torch RNG states

Every process writes into ``.tmp-step_...`` and the main process renames it only after all
of them are done, so a directory named ``step_*`` is always complete: a run killed while
saving resumes from the previous one.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

from dflash_train.config import TrainConfig, as_dict

STEP_DIR = re.compile(r"^step_(\d+)$")
TMP_PREFIX = ".tmp-"
STATE_FILE = "trainer_state.json"
CONFIG_FILE = "config.yaml"


@dataclass
class TrainerState:
    step: int = 0  # optimizer steps done; the data position is step * global_batch samples
    global_batch: int = 0
    nan_skipped: int = 0

    @property
    def samples_seen(self) -> int:
        return self.step * self.global_batch


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(backend, output_dir: str | Path, state: TrainerState, config: TrainConfig, keep_last: int) -> Path:
    """Collective: every process calls it. Returns the final directory."""
    root = checkpoint_root(output_dir)
    final = root / step_dir_name(state.step)
    tmp = root / (TMP_PREFIX + final.name)
    if backend.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # left over from a run killed while saving
        tmp.mkdir(parents=True)
    backend.barrier()
    backend.save_state(tmp)
    torch.save(_rng_state(), tmp / f"rng_rank{backend.rank}.pt")
    if backend.is_main:
        (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=2) + "\n")
        (tmp / CONFIG_FILE).write_text(OmegaConf.to_yaml(as_dict(config)))
    backend.barrier()
    if backend.is_main:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in list_checkpoints(output_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    backend.barrier()
    return final


def load_checkpoint(backend, path: Path, global_batch: int) -> TrainerState:
    """Collective: restore model, optimizer, scheduler, RNG and the data position.

    The data position is a global step of ``global_batch`` samples, which stays meaningful
    on another number of processes only if the global batch is the same.
    """
    state = TrainerState(**json.loads((path / STATE_FILE).read_text()))
    if state.global_batch != global_batch:
        raise ValueError(
            f"checkpoint {path} was trained with global batch {state.global_batch} but this run has "
            f"{global_batch} (micro_batch_size * grad_accum_steps * world_size); keep it equal to resume"
        )
    backend.load_state(path)
    rng = path / f"rng_rank{backend.rank}.pt"
    # A process that did not exist in the saved run keeps its fresh seed: nothing in the
    # data order or anchors depends on the RNG stream, only (seed, epoch, index).
    if rng.exists():
        _set_rng_state(torch.load(rng, weights_only=True))
    return state
