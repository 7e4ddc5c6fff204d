"""GPU timing shared by the benchmark scripts: the median of CUDA-event times. The scripts
import it as ``benchmarks.cuda_timing``: run them from the repository root with
``python -m benchmarks.NAME``."""

from __future__ import annotations

import torch


def median_ms(fn, runs: int = 10, warmup: int = 3) -> float:
    """Median milliseconds of ``fn()`` over ``runs`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[runs // 2]
