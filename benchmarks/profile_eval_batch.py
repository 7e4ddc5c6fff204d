"""Where a batched dflash-eval step spends its time: host (Python, launches) or device.

    python benchmarks/profile_eval_batch.py target=qwen25_coder_05b device=cuda \
        drafter_path=runs/x/export 'datasets=[humaneval]' limit=40 max_new_tokens=256

The config is dflash-eval's. The first dataset's first ``limit`` prompts are decoded as one
batch, speculatively and plainly: first timed as a whole (wall time, steps, milliseconds per
step), then again under the torch profiler for at most ``PROFILED_TOKENS`` new tokens (a
whole run's trace takes minutes to summarise), which gives device-busy milliseconds per step
and the operators that take the most host and device time.
"""

from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile

from dflash_train.eval.batched import spec_generate_batch, target_generate_batch
from dflash_train.eval.job import setup
from dflash_train.eval.settings import EvalConfig, validate
from dflash_train.model.dflash import Sampling
from dflash_train.recipe import load_command

PROFILED_TOKENS = 24


def _device_ms(events) -> float:
    return sum(e.self_device_time_total for e in events) / 1000


def _timed(fn, prompts, new_tokens: int, name: str) -> tuple[float, int]:
    """(wall seconds, decode steps) of one batched run."""
    start = time.perf_counter()
    out = fn(prompts, new_tokens)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    steps = max(len(o.acceptance_lengths) for o in out) if name == "spec" else max(len(new) for new in out)
    return wall, steps


def main(argv: list[str] | None = None) -> None:
    cfg = load_command(EvalConfig, argv, "eval", __doc__, validate)
    datasets, target, drafter, stops, _ = setup(cfg)
    _, items = next(iter(datasets.values()))
    prompts = [ids[0].tolist() for _, ids in items]
    runs = {
        "spec": lambda ps, n: spec_generate_batch(drafter, target.model, ps, n, Sampling(0.0), stops),
        "plain": lambda ps, n: target_generate_batch(target.model, ps, n, stops, 0.0, [[] for _ in ps]),
    }
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    print(f"{len(prompts)} prompts as one batch, {cfg.max_new_tokens} new tokens, {cfg.device} {cfg.dtype}")
    print(f"{'run':<6} {'wall s':>7} {'steps':>6} {'ms/step':>8} {'profiled ms/step':>17} {'device ms/step':>15}")
    tables = {}
    for name, fn in runs.items():
        fn(prompts[:2], 8)  # warm-up: the kernels' first launches
        wall, steps = _timed(fn, prompts, cfg.max_new_tokens, name)
        with profile(activities=activities) as prof:
            p_wall, p_steps = _timed(fn, prompts, min(cfg.max_new_tokens, PROFILED_TOKENS), name)
        tables[name] = prof.key_averages()  # summarising the trace is the slow part: once
        print(f"{name:<6} {wall:>7.2f} {steps:>6} {1000 * wall / steps:>8.1f} {1000 * p_wall / p_steps:>17.1f} "
              f"{_device_ms(tables[name]) / p_steps:>15.1f}")
    for name, events in tables.items():
        print(f"\n{name}: top operators by host time")
        print(events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
        if torch.cuda.is_available():
            print(f"{name}: top operators by device time")
            print(events.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
