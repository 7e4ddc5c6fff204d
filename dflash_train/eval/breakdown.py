"""Where a speculative step of the static runtime spends its time (`eval.speed step_timing=true`).

Each decode step of `speculate_static`'s per-step loop (the one sampling uses) is split at
the laps it marks:
  draft        the block filled in, the drafter's forward (a CUDA graph on a GPU), the drafts
  verify       the target's forward over the block (a CUDA graph on a GPU)
  accept       the acceptance rule, on the device
  host         the step's one device-to-host copy: on a GPU, the host waiting for the device
  bookkeeping  committing tokens, the next context features and anchor
host ms is the wall time between laps with no synchronisation added: on a GPU the time the
host takes to queue each part (the queue drains in `host`), on a CPU the compute itself.
device ms (CUDA) is the GPU time between CUDA events recorded at the same laps, idle gaps
included. ops: top-level ATen calls the host makes; kernels (CUDA): kernels the profiler puts
in the part's range; a replayed graph's kernels are not among them (on an H100 the verify
part shows 1 launch and 0 kernels), only in the step's total printed below the table;
launches (CUDA): the kernel, graph and copy
launch calls the host makes. Counts come from one decode under torch.profiler. The plain
step is the static runtime's one-token step (a CUDA graph on a GPU) over the same prompts.
Below the table: the greedy device loop's step (`StaticSpeculator.advance`, what untimed
greedy decoding runs), its decode time over its steps with no clock inside.

Shapes: a prompt's input ids are (1, T).
"""

from __future__ import annotations

import time

import torch
from torch.autograd import DeviceType

from dflash_train.eval.acceptance import plain_decode, timed
from dflash_train.model.dflash import NO_CLOCK, Sampling
from dflash_train.model.runtime import speculate_static

PARTS = ("draft", "verify", "accept", "host", "bookkeeping")
# CUDA runtime and driver calls that put work on the device (names may carry a version suffix)
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "cuGraphLaunch", "cudaMemcpy", "cudaMemset")
RANGE = "dflash_step_part_"  # profiler ranges between laps; which part each was is known when it ends


class PartClock:
    """A step clock (`lap(part)`, `result()`) that never synchronises inside a step."""

    def __init__(self, device: torch.device, profiling: bool = False):
        self.cuda, self.profiling = device.type == "cuda", profiling
        self.host = dict.fromkeys(PARTS, 0.0)
        self.events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []  # (part, start, end)
        self.steps = 0
        self.last = self.last_event = None
        self.ranges: list[str | None] = []  # the part each profiler range ended as; None: between steps
        self.open = None

    def lap(self, part: str | None = None) -> None:
        now, event = time.perf_counter(), None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        if part is None:  # a step begins
            self.steps += 1
        else:
            self.host[part] += now - self.last
            if self.cuda:
                self.events.append((part, self.last_event, event))
        self.last, self.last_event = now, event
        if self.profiling:
            self.close(part)
            self.open = torch.profiler.record_function(f"{RANGE}{len(self.ranges)}")
            self.open.__enter__()

    def close(self, part: str | None = None) -> None:
        """End the open profiler range as ``part``."""
        if self.open is not None:
            self.open.__exit__(None, None, None)
            self.ranges.append(part)
            self.open = None

    def result(self) -> dict:
        device = None
        if self.cuda:
            torch.cuda.synchronize()
            device = dict.fromkeys(PARTS, 0.0)
            for part, start, end in self.events:
                device[part] += start.elapsed_time(end) / 1e3
        return {"steps": self.steps, "host_s": dict(self.host), "device_s": device}


def _count(event, counts: dict, in_op: bool = False) -> None:
    """Add ``event``'s subtree to ``counts``: top-level ATen ops, kernels, launch calls."""
    is_op = event.name.startswith("aten::")
    counts["ops"] += is_op and not in_op
    counts["kernels"] += len(event.kernels)
    counts["launches"] += event.name.startswith(LAUNCH_CALLS)
    for child in event.cpu_children:
        _count(child, counts, in_op or is_op)


def part_counts(events, ranges: list[str | None]) -> tuple[dict, int]:
    """Per part {ops, kernels, launches} over the profiled ranges, and every kernel the
    device ran in the profile (some may fall between the parts)."""
    counts = {part: {"ops": 0, "kernels": 0, "launches": 0} for part in PARTS}
    for event in events:
        if event.name.startswith(RANGE):
            part = ranges[int(event.name[len(RANGE):])]
            if part is not None:
                _count(event, counts[part])
    kernels = sum(1 for event in events if event.device_type == DeviceType.CUDA)
    return counts, kernels


def _profiled_counts(drafter, target, input_ids, max_new_tokens: int, verify_tokens: int | None) -> dict:
    """One decode under torch.profiler: per-step counts of each part."""
    from torch.profiler import ProfilerActivity, profile

    device = input_ids.device
    clock = PartClock(device, profiling=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        speculate_static(drafter, target, input_ids, max_new_tokens, Sampling(), [], None, None, clock,
                         verify_tokens=verify_tokens)
        clock.close()
    counts, kernels = part_counts(prof.events(), clock.ranges)
    per_step = {part: {k: v / clock.steps for k, v in c.items()} for part, c in counts.items()}
    return {"parts": per_step, "kernels_per_step": kernels / clock.steps if device.type == "cuda" else None}


def plain_step_s(target, prompts: list[torch.Tensor], max_new_tokens: int) -> float:
    """Seconds per plain static step: whole decodes less one-token decodes (the prefills)."""
    device = prompts[0].device
    full = sum(timed(lambda ids=ids: plain_decode(target, ids, max_new_tokens, [], 0.0, None, True), device)[1]
               for ids in prompts)
    first = sum(timed(lambda ids=ids: plain_decode(target, ids, 1, [], 0.0, None, True), device)[1]
                for ids in prompts)
    return (full - first) / (len(prompts) * (max_new_tokens - 1))


@torch.inference_mode()
def step_breakdown(drafter, target, prompts: list[torch.Tensor], max_new_tokens: int,
                   verify_tokens: int | None = None) -> dict:
    """The static runtime's per-step cost over ``prompts``, greedy, no stop tokens, the
    target verifying ``verify_tokens`` drafts a step (None: the whole block).

    The first prompt is decoded once untimed first (cache sizing, graph capture).
    """
    def spec(ids, clock=NO_CLOCK):
        return speculate_static(drafter, target, ids, max_new_tokens, Sampling(), [], None, None, clock,
                                verify_tokens=verify_tokens)

    device = prompts[0].device
    spec(prompts[0])
    plain_decode(target, prompts[0], max_new_tokens, [], 0.0, None, True)
    clock = PartClock(device)
    lengths = []
    for ids in prompts:
        out = spec(ids, clock)
        lengths += out.acceptance_lengths
    timing = clock.result()
    loop_s = loop_steps = 0  # the same decodes untimed: the device loop (`StaticSpeculator.advance`)
    for ids in prompts:
        out = spec(ids)
        loop_s, loop_steps = loop_s + out.decode_s, loop_steps + len(out.acceptance_lengths)
    counts = _profiled_counts(drafter, target, prompts[0], max_new_tokens, verify_tokens)
    steps = timing["steps"]
    parts = {}
    for part in PARTS:
        device_s = None if timing["device_s"] is None else timing["device_s"][part]
        parts[part] = {"host_ms": 1e3 * timing["host_s"][part] / steps,
                       "device_ms": None if device_s is None else 1e3 * device_s / steps, **counts["parts"][part]}
    return {"device": device.type, "prompts": len(prompts), "steps": steps, "tau": sum(lengths) / len(lengths),
            "parts": parts, "kernels_per_step": counts["kernels_per_step"], "loop_step_ms": 1e3 * loop_s / loop_steps,
            "plain_step_ms": 1e3 * plain_step_s(target, prompts, max_new_tokens)}


def format_breakdown(b: dict) -> str:
    cuda = b["device"] == "cuda"
    step_ms = sum(p["host_ms"] for p in b["parts"].values())
    head = (f"per speculative step, static runtime ({b['prompts']} prompts, {b['steps']} steps, tau {b['tau']:.2f}): "
            f"{step_ms:.2f} ms = {step_ms / b['plain_step_ms']:.2f} plain steps of {b['plain_step_ms']:.2f} ms")
    header = f"{'part':<12} {'host ms':>8} {'device ms':>10} {'ops':>7} {'kernels':>8} {'launches':>9}"
    rows = [head, header, "-" * len(header)]

    def row(name, host, device, ops, kernels, launches):
        shown = [f"{device:.2f}" if cuda else "-", f"{kernels:.0f}" if cuda else "-", f"{launches:.0f}" if cuda else "-"]
        rows.append(f"{name:<12} {host:>8.2f} {shown[0]:>10} {ops:>7.0f} {shown[1]:>8} {shown[2]:>9}")

    for name, p in b["parts"].items():
        row(name, p["host_ms"], p["device_ms"], p["ops"], p["kernels"], p["launches"])
    total = {k: sum(p[k] or 0 for p in b["parts"].values()) for k in ("device_ms", "ops", "kernels", "launches")}
    row("step", step_ms, total["device_ms"], total["ops"], total["kernels"], total["launches"])
    rows.append(f"the device loop (greedy, untimed: every step decided on the device, one graph a step on a GPU): "
                f"{b['loop_step_ms']:.2f} ms a step = {b['loop_step_ms'] / b['plain_step_ms']:.2f} plain steps")
    if cuda:
        rows.append(f"kernels the device ran per step in the profile, between parts included: "
                    f"{b['kernels_per_step']:.0f}")
    else:
        rows.append("on a CPU host ms is the compute; device times and kernel counts need a GPU")
    return "\n".join(rows)
