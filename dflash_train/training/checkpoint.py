"""Training checkpoints: full state, written atomically, the last N kept, resumed from the latest.

Layout under ``<output_dir>/checkpoints/``::

    step_00000120/
        model.pt optimizer.pt scheduler.pt   the backend's world-size-independent state, or
        sharded/ scheduler.pt                FSDP2's: model and optimizer shards written by
                                             every rank (torch.distributed.checkpoint),
                                             read back at any world size and by any backend
        trainer_state.json                   step, samples seen, counters, global batch, the
                                             target's weights digest, the format version
        config.yaml                          the resolved recipe of the run
        rng_rank{r}.pt                       each process's torch RNG states
        checksums.json                       sha256 of every file above, written last

Every process writes into ``.tmp-step_...`` and the main process renames it only after all
of them are done, so a directory named ``step_*`` is always complete: a run killed while
saving resumes from the previous one. With ``checkpoint.async_write`` training stops only
while the state is copied into host memory (the main process's, or under FSDP2 each rank its
own shards) and each process writes its RNG file; the state's files, the main process's
checksums, the rename and the pruning then run on one background thread per process
(``CheckpointWriter``), at most one checkpoint at a time. The rename waits for every rank's
shards. Its errors are raised in the training process at the next save or at the end of
training, as a synchronous save raises them. A checkpoint damaged later (a bad disk, a truncated
copy) fails its checksums: it is reported and the previous good one is used. A checksums
file missing where the run writes one (a checkpoint of format 2, or one whose siblings have
theirs) is damage too: nothing could tell its files are the ones written. Checkpoints of
older versions have none and are used as they are, reported as unverified.

A resumed run must compute what the checkpointed one did: ``changed_settings`` lists the
recipe keys that differ in a way that changes the computation (data, optimisation, drafter
geometry, target, seed, loss, epochs); the others (logging, checkpoint cadence, max_steps,
output_dir, hub, backend, how the global batch is split) may change freely.
"""

from __future__ import annotations

import json
import logging
import pickle
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from functools import partial
from pathlib import Path

import torch
from omegaconf import OmegaConf

from dflash_train.atomic import disk_full, disk_full_error, file_sha256, publish
from dflash_train.config import TrainConfig, as_dict
from dflash_train.training.run_dir import STEP_DIR, checkpoint_root, list_checkpoints

TMP_PREFIX = ".tmp-"
STATE_FILE = "trainer_state.json"
CONFIG_FILE = "config.yaml"
CHECKSUMS_FILE = "checksums.json"
# trainer_state.json's "format": 2 since checkpoints always carry checksums.json.
STATE_FORMAT = 2
# Sections and keys of the recipe that change what a resumed run computes ...
RESUME_CHECKED = ("target", "drafter", "data", "optim", "loss", "seed", "epochs")
# ... except these inside them: how attention is implemented or memory is saved, checks,
# validation cadence and the split of the global batch (itself checked) leave the math as is.
RESUME_FREE = frozenset({
    "drafter.attention", "drafter.flex_backend", "drafter.activation_checkpointing", "drafter.compile", "data.check_manifest",
    "data.val_every", "data.cache_features", "optim.micro_batch_size", "optim.grad_accum_steps", "loss.chunk_size",
})
log = logging.getLogger(__name__)


@dataclass
class TrainerState:
    step: int = 0  # optimizer steps done; the data position is step * global_batch samples
    global_batch: int = 0
    nan_skipped: int = 0
    target_weights: str | None = None  # model/target.py's weights_digest of the target trained with

    @property
    def samples_seen(self) -> int:
        return self.step * self.global_batch


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def write_checksums(directory: Path) -> None:
    """sha256 of every file under ``directory`` (the sharded format's in a subfolder), keyed
    by its relative path."""
    files = [p for p in sorted(directory.rglob("*")) if p.is_file() and p.name != CHECKSUMS_FILE]
    sums = {p.relative_to(directory).as_posix(): file_sha256(p) for p in files}
    (directory / CHECKSUMS_FILE).write_text(json.dumps(sums, indent=2) + "\n")


def read_state(path: Path) -> dict:
    """A checkpoint's trainer_state.json as written (unknown keys kept; {} when unreadable)."""
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def unverified(path: Path) -> bool:
    """Whether checkpoint ``path`` has no checksums (one of an older version: used as it is)."""
    return not (path / CHECKSUMS_FILE).is_file()


def _writes_checksums(path: Path) -> bool:
    siblings = [p for p in path.parent.iterdir() if p != path and STEP_DIR.match(p.name) and p.is_dir()]
    return read_state(path).get("format", 1) >= STATE_FORMAT or any(not unverified(p) for p in siblings)


def checkpoint_problem(path: Path) -> str | None:
    """Why checkpoint ``path`` cannot be trusted, or None when every checksum matches
    (or when it is one of an older version without checksums: see ``unverified``)."""
    sums_file = path / CHECKSUMS_FILE
    if not sums_file.is_file():
        missing = [name for name in (STATE_FILE, CONFIG_FILE) if not (path / name).is_file()]
        if missing:
            return f"missing {missing}"
        if _writes_checksums(path):
            return f"{CHECKSUMS_FILE} is missing where this run writes one: its files cannot be verified"
        return None
    try:
        sums = json.loads(sums_file.read_text())
    except ValueError:
        return f"{CHECKSUMS_FILE} is damaged"
    for name, digest in sums.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file_sha256(file) != digest:
            return f"{name} does not match its checksum (damaged or truncated)"
    return None


def latest_good_checkpoint(output_dir: str | Path,
                           remedy: str = "remove them to start over, or use another output_dir") -> Path | None:
    """The newest checkpoint whose files match their checksums; damaged ones are reported.

    None when there is no checkpoint; a ValueError ending in ``remedy`` (what the calling
    command's user can do) when there are some but none is good."""
    found = list_checkpoints(output_dir)
    bad = []
    for path in reversed(found):
        problem = checkpoint_problem(path)
        if problem is None:
            if unverified(path):
                log.warning("checkpoint %s has no %s (written by an older version): its files cannot be verified",
                            path, CHECKSUMS_FILE)
            return path
        log.warning("checkpoint %s is damaged (%s); trying the previous one", path, problem)
        bad.append(f"{path.name}: {problem}")
    if bad:
        raise ValueError(f"no usable checkpoint in {checkpoint_root(output_dir)}: {'; '.join(bad)}; {remedy}")
    return None


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def changed_settings(old: dict, new: dict) -> list[str]:
    """``key: old -> new`` for each setting that changes what a resumed run computes.

    Keys the checkpointed recipe lacks (written by an older version) are not compared."""
    before, after = _flat(old), _flat(new)
    changes = []
    for key in sorted(after):
        if key.split(".")[0] not in RESUME_CHECKED or key in RESUME_FREE or key not in before:
            continue
        if before[key] != after[key]:
            changes.append(f"{key}: {before[key]!r} -> {after[key]!r}")
    return changes


def _same_weights(old_spec: str, new_spec: str) -> bool:
    """Whether two target specs name the same weights (another path to the same file)."""
    from dflash_train.model.target import weights_digest

    try:
        return weights_digest(old_spec) == weights_digest(new_spec)
    except (ValueError, OSError):  # the old path is gone: it cannot be shown to be the same
        return False


def _content_digest(digest: str | None) -> bool:
    return bool(digest) and not digest.startswith("hub-")  # a hub id never downloaded has none


def resume_changes(path: Path, new: dict, target_weights: str | None) -> list[str]:
    """``changed_settings`` from checkpoint ``path``'s recipe to ``new``, the target compared
    by its weights: against the digest the checkpoint recorded (another file at the same path
    is a change), or for older checkpoints the digests of both names (the same file under
    another path is not)."""
    old = checkpoint_config(path)
    changes = changed_settings(old, new)
    named = [c for c in changes if c.startswith("target.name:")]
    recorded = read_state(path).get("target_weights")
    if _content_digest(recorded) and _content_digest(target_weights):
        same = recorded == target_weights
        if not same:
            changes.append(f"target weights: {recorded!r} -> {target_weights!r}")
    else:
        same = bool(named) and _same_weights(old["target"]["name"], new["target"]["name"])
    return [c for c in changes if not (same and c in named)]


def drafter_shape_change(old: dict, config, target_hf_config) -> str | None:
    """The first weight whose shape differs between the drafter of recipe ``old`` and one of
    ``config`` (a DFlashConfig) for the same target, or None: ``name old -> new``."""
    from dflash_train.config import to_train_config
    from dflash_train.model.init import drafter_config
    from dflash_train.model.kinds import new_drafter

    try:
        before_config = drafter_config(to_train_config(OmegaConf.create(old)), target_hf_config)
    except ValueError:  # a recipe this version no longer reads: loading the state will tell
        return None
    with torch.device("meta"):  # names and shapes only
        before = {k: tuple(v.shape) for k, v in new_drafter(before_config).state_dict().items()}
        after = {k: tuple(v.shape) for k, v in new_drafter(config).state_dict().items()}
    for name in sorted(set(before) | set(after)):
        if before.get(name) != after.get(name):
            return f"{name} {before.get(name, 'absent')} -> {after.get(name, 'absent')}"
    return None


def checkpoint_config(path: Path) -> dict:
    """The recipe a checkpoint was trained with, as a plain dict."""
    return OmegaConf.to_container(OmegaConf.load(path / CONFIG_FILE))


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointWriter:
    """A process's checkpoint writer: one background thread, one write in flight.

    ``save_checkpoint`` hands it the files of a checkpoint whose state is already copied;
    ``wait`` returns once they are written (on the main process: published), and raises here,
    in the training process, the error the write met (a full disk: the same one line as a
    synchronous save)."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-checkpoint")
        self._pending: tuple[str, Future] | None = None

    def submit(self, name: str, write: Callable[[], None], stopped_s: float | None) -> None:
        """Writes checkpoint ``name`` with ``write`` on the thread; training was stopped
        ``stopped_s`` seconds for it (logged with the write's time; None: not logged, a
        process other than the main one). Call ``wait`` first."""
        assert self._pending is None, "a checkpoint write is still in flight"
        self._pending = name, self._pool.submit(self._write, name, write, stopped_s)

    @staticmethod
    def _write(name: str, write: Callable[[], None], stopped_s: float | None) -> None:
        started = time.perf_counter()
        write()
        if stopped_s is not None:
            log.info("checkpoint %s snapshot %.1f s, written in the background in %.1f s",
                     name, stopped_s, time.perf_counter() - started)

    def wait(self) -> float:
        """Blocks until the write in flight, if any, is done (on the main process: published),
        raising its error; returns the seconds it blocked."""
        if self._pending is None:
            return 0.0
        started = time.perf_counter()
        (_, pending), self._pending = self._pending, None
        pending.result()
        return time.perf_counter() - started

    def close(self) -> None:
        """``wait`` for a process that is already stopping on another error: the write in
        flight completes (a checkpoint to resume from), its own error is logged, not raised
        over the first."""
        name = self._pending[0] if self._pending is not None else None
        try:
            self.wait()
        except Exception as err:  # logged: the error already propagating is the one raised
            log.error("checkpoint %s was not written: %s", name, err)


@contextmanager
def _removed_on_failure(tmp: Path, final: Path, output_dir: str | Path) -> Iterator[None]:
    """Removes the partial folder ``tmp`` of checkpoint ``final`` if the body fails (left, it
    would keep the disk full until the next run) and tells a full disk in one line."""
    try:
        yield
    except (OSError, RuntimeError) as err:
        shutil.rmtree(tmp, ignore_errors=True)
        root = tmp.parent
        if disk_full(err, root):
            previous = list_checkpoints(output_dir)
            kept = f"the last checkpoint, {previous[-1].name}, is kept" if previous else "there is no earlier checkpoint"
            raise disk_full_error(root, f"checkpoint {final.name}", f"its partial folder was removed and {kept}") \
                from err
        raise


def _write_rest(write_staged: Callable[[], None] | None, texts: dict[str, str] | None, tmp: Path, final: Path,
                output_dir: str | Path, keep_last: int) -> None:
    """A process's part of a checkpoint once every process's own small files are in ``tmp``:
    the state (``write_staged``, what ``Backend.stage_state`` returned; None: ``save_state``
    wrote it), then on the main process (``texts``: the trainer state and recipe; None on the
    others) the checksums, the rename into place and the pruning to ``keep_last``."""
    with _removed_on_failure(tmp, final, output_dir):
        if write_staged is not None:
            write_staged()  # on the main process it returns once every process's part is written
        if texts is None:
            return
        for name, text in texts.items():
            (tmp / name).write_text(text)
        write_checksums(tmp)  # last: a checkpoint whose files match it is complete and intact
        publish(tmp, final)  # fsynced, then renamed into place
    for old in list_checkpoints(output_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(backend, output_dir: str | Path, state: TrainerState, config: TrainConfig, keep_last: int,
                    writer: CheckpointWriter | None = None) -> Path:
    """Collective: every process calls it. Returns the final directory.

    Given a ``writer``, it returns once the state is copied to host memory
    (``Backend.stage_state``) and every process's own small files are written; the state's
    files are written on the writers' threads, and the directory appears when the main
    process's has written the rest (``writer.wait``). Otherwise the directory is complete
    when it returns."""
    root = checkpoint_root(output_dir)
    final = root / step_dir_name(state.step)
    tmp = root / (TMP_PREFIX + final.name)
    background = writer is not None
    if background:
        writer.wait()  # one write in flight at most
    started = time.perf_counter()
    if backend.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # left over from a run killed while saving
        tmp.mkdir(parents=True)
    backend.barrier()
    write_staged = None
    with _removed_on_failure(tmp, final, output_dir):
        if background:
            write_staged = backend.stage_state(tmp)
        else:
            backend.save_state(tmp)
        torch.save(_rng_state(), tmp / f"rng_rank{backend.rank}.pt")
        backend.barrier()  # every process's own files are in tmp
    texts = None
    if backend.is_main:
        # Taken now: the trainer's state moves on while the thread writes.
        texts = {STATE_FILE: json.dumps({**asdict(state), "format": STATE_FORMAT}, indent=2) + "\n",
                 CONFIG_FILE: OmegaConf.to_yaml(as_dict(config))}
    write = partial(_write_rest, write_staged, texts, tmp, final, output_dir, keep_last)
    if background:
        if backend.is_main or write_staged is not None:  # the others of the full format have nothing left
            writer.submit(final.name, write, time.perf_counter() - started if backend.is_main else None)
    elif backend.is_main:
        write()
        log.info("checkpoint %s written in %.1f s", final.name, time.perf_counter() - started)
    backend.barrier()
    return final


def load_checkpoint(backend, path: Path, global_batch: int) -> TrainerState:
    """Collective: restore model, optimizer, scheduler, RNG and the data position.

    The data position is a global step of ``global_batch`` samples, which stays meaningful
    on another number of processes only if the global batch is the same.
    """
    known = {f.name for f in fields(TrainerState)}
    state = TrainerState(**{k: v for k, v in json.loads((path / STATE_FILE).read_text()).items() if k in known})
    if state.global_batch != global_batch:
        raise ValueError(
            f"checkpoint {path} was trained with global batch {state.global_batch} but this run has "
            f"{global_batch} (micro_batch_size * grad_accum_steps * world_size); keep it equal to resume"
        )
    try:
        backend.load_state(path)
        rng = path / f"rng_rank{backend.rank}.pt"
        # A process that did not exist in the saved run keeps its fresh seed: nothing in the
        # data order or anchors depends on the RNG stream, only (seed, epoch, index).
        if rng.exists():
            _set_rng_state(torch.load(rng, weights_only=True))
    except (RuntimeError, EOFError, KeyError, pickle.UnpicklingError) as err:
        # A drafter of another geometry (size mismatch) or an unreadable file.
        detail = " ".join(str(err).split())[:300] or type(err).__name__
        raise ValueError(f"checkpoint {path} cannot be loaded into this run: {detail}") from None
    return state
