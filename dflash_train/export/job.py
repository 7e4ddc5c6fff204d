"""dflash-export's work: find the checkpoint, write its drafter in the contract format, push it.

export/cli.py reads the command line and imports this module only once the settings are
valid, so a mistake in them is refused without importing torch.
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

from dflash_train.config import as_dict, to_train_config
from dflash_train.errors import RunError, one_line
from dflash_train.eval.report import results_table
from dflash_train.export.hub import push_to_hub
from dflash_train.model.card import model_card_files
from dflash_train.model.init import drafter_config
from dflash_train.model.io import check_export_destination, save_drafter
from dflash_train.model.kinds import new_drafter
from dflash_train.model.target import resolve_target, weights_digest
from dflash_train.run_lock import hold_folder
from dflash_train.training.checkpoint import (
    CHECKSUMS_FILE,
    CONFIG_FILE,
    STATE_FILE,
    checkpoint_problem,
    latest_good_checkpoint,
    read_state,
    unverified,
)
from dflash_train.training.run_dir import EXPORT_DIR, MANIFEST_COPY
from dflash_train.training.state_files import (
    SHARDED_DIR,
    STATE_FILES,
    is_sharded,
    read_model_state,
)


def find_checkpoint(path: Path) -> Path:
    """``path`` itself when it is a checkpoint, else the latest checkpoint of a run directory."""
    if (path / STATE_FILE).is_file():
        problem = checkpoint_problem(path)
        if problem is not None:
            raise ValueError(f"checkpoint {path} is damaged: {problem}")
        return path
    latest = latest_good_checkpoint(path, "nothing to export: give path=<a good checkpoint directory>")
    if latest is None:
        raise ValueError(f"{path} is neither a checkpoint (no {STATE_FILE}) nor a run directory with checkpoints/")
    return latest


def export_checkpoint(ckpt: Path, out: Path, eval_results: str | None = None) -> tuple[Path, dict]:
    """Write the drafter of ``ckpt`` to ``out``; returns the export directory and the run config."""
    from transformers import AutoConfig

    cfg = to_train_config(OmegaConf.load(ckpt / CONFIG_FILE))
    config = drafter_config(cfg, AutoConfig.from_pretrained(resolve_target(cfg.target.name)))
    with torch.device("meta"):  # only the config is needed; the weights come from the checkpoint
        shell = new_drafter(config)
    try:
        state = read_model_state(ckpt)
    except (RuntimeError, EOFError, pickle.UnpicklingError) as err:
        source = ckpt / (SHARDED_DIR if is_sharded(ckpt) else STATE_FILES["model"])
        raise ValueError(f"{source}: unreadable ({' '.join(str(err).split())[:200]})") from None
    run_dir = ckpt.parent.parent
    manifest_file = run_dir / MANIFEST_COPY
    manifest = json.loads(manifest_file.read_text()) if manifest_file.is_file() else None
    key = "eval_results" if eval_results else "hub.eval_results"
    extra = model_card_files(as_dict(cfg), manifest, results_table(eval_results or cfg.hub.eval_results, key))
    # The digest the run recorded; checkpoints of older versions: the recipe's target now.
    digest = read_state(ckpt).get("target_weights") or weights_digest(cfg.target.name)
    return save_drafter(shell, out, extra_files=extra, state_dict=state, target_weights=digest), as_dict(cfg)


def export_and_push(args) -> None:
    """Export (and push) what ``args``, dflash-export's ExportConfig, names."""
    ckpt = find_checkpoint(Path(args.path))
    if unverified(ckpt):
        print(f"dflash-export: warning: {ckpt} has no {CHECKSUMS_FILE} (a checkpoint of an older version): "
              "its files cannot be verified", file=sys.stderr)
    out = Path(args.out) if args.out else ckpt.parent.parent / EXPORT_DIR
    check_export_destination(out)  # before any checkpoint is read: a user's folder is refused at once
    results_table(args.eval_results)  # a file that is not dflash-eval's: its one line now, not after the export
    # The export is written beside its destination and renamed into place: the folder
    # holding it (the run's own by default) is the one this command writes.
    with hold_folder(out.parent, "out" if args.out else "path", "dflash-export"):
        _export_and_push(args, ckpt, out)


def _export_and_push(args, ckpt: Path, out: Path) -> None:
    hub = OmegaConf.load(ckpt / CONFIG_FILE).get("hub") or {}
    repo_id = args.repo_id or hub.get("repo_id")
    if args.push and not repo_id:  # before the export: the command as given cannot finish
        raise ValueError("push=true needs a Hub repository: add repo_id=<user>/<name> (the run's recipe has no "
                         "hub.repo_id)")
    export, cfg = export_checkpoint(ckpt, out, args.eval_results)
    print(f"exported {ckpt} to {export}")
    if args.push:
        private = cfg["hub"]["private"] if args.private is None else args.private
        print(f"pushed to {repo_id}: {_push(ckpt, export, repo_id, private)}")


def _push(ckpt: Path, export: Path, repo_id: str, private: bool) -> str:
    try:
        return push_to_hub(export, repo_id, private)
    except Exception as err:  # the hub client's errors, its HTTP library's included: not bugs of ours
        raise RunError(f"push to {repo_id} failed ({type(err).__name__}: {one_line(err)}); the export is on disk "
                       f"at {export}: push it later with dflash-export {ckpt} out={export} push=true "
                       f"repo_id={repo_id}") from None
