"""Metrics sinks of the main process: JSON lines, wandb and a tqdm progress bar.

wandb runs offline unless the recipe says ``logging.wandb: online``; its own environment
variables (WANDB_MODE, WANDB_API_KEY, ...) keep their usual meaning.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from dflash_train.config import LoggingConfig
from dflash_train.contract import acceptance_length, expected_acceptance_length
from dflash_train.training.flops import peak_memory_gib
from dflash_train.training.run_dir import METRICS_FILE


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep the line parseable
    return value


def _lines_up_to(path: Path, step: int) -> list[str]:
    """The metric lines of steps <= ``step``: a resumed run's history. Later lines belong to
    steps it will run again (logged after the checkpoint it resumes from), or, when it starts
    from step 0, to an earlier run that left no checkpoint; keeping them would mix two runs."""
    if step == 0 or not path.exists():
        return []
    kept = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
        except (ValueError, KeyError, TypeError):
            break  # a line cut by a crash ends the readable history
    return kept


class MetricsLogger:
    """Writes metric dicts; a no-op on every process but the main one."""

    def __init__(self, cfg: LoggingConfig, output_dir: Path, total_steps: int, start_step: int,
                 is_main: bool, run_config: dict):
        self.enabled = is_main
        self.bar = None
        self.val_tau: str | None = None
        self.wandb_run = None
        if not is_main:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        path = output_dir / METRICS_FILE
        kept = _lines_up_to(path, start_step)
        self.file = open(path, "w")
        self.file.writelines(kept)
        self.file.flush()
        if cfg.progress_bar:
            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)
        if cfg.wandb != "disabled":
            self.wandb_run = _start_wandb(cfg, output_dir, run_config)

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        line = {"step": step, "time": round(time.time(), 3), **{k: _jsonable(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=step)
        if self.bar is not None:
            # tau counted block by block, training rows and held out (the expected taus, made
            # of per-slot accuracies, are in metrics.jsonl)
            if "val_tau" in metrics:  # kept on the bar until the next validation
                self.val_tau = f"{metrics['val_tau']:.2f}"
            shown = {"loss": f"{metrics['loss']:.3f}", "tau": f"{metrics['tau']:.2f}"}
            if self.val_tau is not None:
                shown["val_tau"] = self.val_tau
            self.bar.set_postfix(shown, refresh=False)

    def advance(self, steps: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(steps)

    def close(self) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
        self.file.close()


def _start_wandb(cfg: LoggingConfig, output_dir: Path, run_config: dict):
    import wandb

    return wandb.init(
        project=cfg.project,
        name=cfg.run_name,
        dir=str(output_dir),
        mode=cfg.wandb,
        config=run_config,
        # The run id follows the output directory, so a resumed run continues its history.
        id=_run_id(output_dir),
        resume="allow",
    )


def _run_id(output_dir: Path) -> str:
    return hashlib.sha256(str(output_dir.resolve()).encode()).hexdigest()[:16]


def position_accuracy(correct, count) -> list[float]:
    """Accuracy of slots 1..B-1 from per-slot hit and supervised counts (slot 0 is the
    anchor and never predicted); NaN for a slot with nothing supervised."""
    return [float(c) / float(n) if n else float("nan") for c, n in zip(correct[1:], count[1:])]


class MetricWindow:
    """Sums of the globally reduced step statistics between two metric lines."""

    def __init__(self, block_size: int, peak_flops: float | None):
        self.block_size = block_size
        self.peak_flops = peak_flops
        self.reset()

    def reset(self) -> None:
        self.loss_sum = self.weight_sum = self.tokens = self.flops = self.seconds = 0.0
        self.blocks = self.accepted = 0.0
        self.samples = 0
        self.correct = [0.0] * self.block_size
        self.count = [0.0] * self.block_size
        self.grad_norm = float("nan")

    def add(self, sums: dict, seconds: float) -> None:
        self.seconds += seconds
        self.samples += float(sums["conversations"])
        self.tokens += float(sums["tokens"])
        self.flops += float(sums["flops"])
        if not sums["finite"]:
            return  # a skipped step teaches nothing: keep its NaN out of the averages
        self.loss_sum += float(sums["loss_sum"])
        self.weight_sum += float(sums["weight_sum"])
        self.blocks += float(sums["blocks"])
        self.accepted += float(sums["accepted"])
        self.correct = [a + float(b) for a, b in zip(self.correct, sums["correct"])]
        self.count = [a + float(b) for a, b in zip(self.count, sums["count"])]
        self.grad_norm = sums["grad_norm"]

    def summary(self, lr: float, nan_skipped: int, world_size: int, device) -> dict:
        acc = position_accuracy(self.correct, self.count)
        out = {
            "loss": self.loss_sum / self.weight_sum if self.weight_sum else float("nan"),
            "expected_tau": expected_acceptance_length(torch.tensor(acc)),
            "tau": acceptance_length(self.blocks, self.accepted),
            **{f"acc_pos_{k}": a for k, a in enumerate(acc, start=1)},
            "lr": lr,
            "grad_norm": self.grad_norm,
            "tokens_per_s": self.tokens / self.seconds,
            "samples_per_s": self.samples / self.seconds,  # conversations, packed or not
            "conversations": self.samples,  # trained on since the previous metric line
            "peak_memory_gib": peak_memory_gib(device),
            "nan_skipped": nan_skipped,
        }
        if self.peak_flops:
            out["mfu"] = self.flops / self.seconds / (self.peak_flops * world_size)
        return out
