"""Timing shared by the benchmark scripts: the median of CUDA-event times (`median_ms`), a step's
device time replayed as a CUDA graph or its host time on a CPU (`step_seconds`), and two calls
timed taking turns on a CPU or a GPU (`timer`: old against new, a busy host slows both). The scripts
import it as ``benchmarks.cuda_timing``: run them from the repository root with
``python -m benchmarks.NAME``."""

from __future__ import annotations

import time

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


def step_seconds(step, device: torch.device, runs: int) -> float:
    """Median seconds of `step` after one untimed call (compilation): on a GPU a CUDA graph of it
    replayed (device time, no launch gaps), warmed up on a side stream; on a CPU the call itself."""
    if device.type != "cuda":
        step()
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        return sorted(times)[runs // 2]
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[runs // 2]


def timer(device: torch.device, runs: int):
    """(median ms of ``first()``, of ``now()``) over ``runs`` calls each after one untimed call
    each (compilation); the calls take turns, so a busy host slows both alike."""
    def call_ms(fn) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return 1e3 * (time.perf_counter() - start)

    def medians(first, now) -> tuple[float, float]:
        first(), now()
        times = [(call_ms(first), call_ms(now)) for _ in range(runs)]
        return tuple(sorted(t)[runs // 2] for t in zip(*times))
    return medians
