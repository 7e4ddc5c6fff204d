"""Where a target forward's time goes, grouped by what each kernel is for (issue 41).

`profile_call(fn, model, device)` runs ``fn`` (a captured step's function, called eagerly:
a kernel's GPU time does not depend on the graph it is launched from) `CALLS` times under
torch.profiler with every Linear, norm and embedding module of ``model`` wrapped in a
profiler range, and sums each op's own kernel time (GPU) or own CPU time (CPU) into a group:

  qkv / o / gate-up / down / lm_head GEMM   the Linear modules by their name
  attention (sdpa)        scaled_dot_product_attention and what it launches
  K/V repeat for GQA      transformers' repeat_kv: K and V copied to every query head
  cache writes            the K/V written into the slot buffers (index_copy_, scatter_)
  norms                   the RMSNorm modules (input, post-attention, q/k, final)
  elementwise             rotary, residual adds, the activation, layout copies
  embedding               the token embedding
  runtime                 ops outside the target's forward: the slot mask, the features' concat
  host                    (CPU only) Python time between ops, inside a range
  other                   any op none of the above names (listed in the table)

Beside each group: the bytes its ops move (inputs read + outputs written, from the shapes the
profiler records, in the model's dtype: the fp32 upcasts of norms are not counted) and the
time those bytes take at `BANDWIDTH` (one H100 SXM's HBM3), so a row says how far the group
is from bandwidth. On a CPU the times are host compute and mean nothing for the GPU.
"""

from __future__ import annotations

import math
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

PART = "part:"  # the prefix of our ranges in the profile
DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # kineto's device activities that are work (not ranges)
CALLS = 3  # profiled calls of a step, after one untimed call; figures are per call
BANDWIDTH = 3.35e12  # bytes/s: one H100 SXM's HBM3
GEMM_ROLES = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o", "gate_proj": "gate/up",
              "up_proj": "gate/up", "down_proj": "down", "lm_head": "lm_head"}
GROUPS = ("qkv GEMM", "o GEMM", "gate/up GEMM", "down GEMM", "lm_head GEMM", "attention (sdpa)",
          "K/V repeat for GQA", "cache writes", "norms", "elementwise", "embedding", "runtime", "host", "other")
SDPA = "aten::scaled_dot_product_attention"
CACHE_WRITES = ("aten::index_copy_", "aten::scatter_")
ELEMENTWISE = {"aten::" + op for op in (
    "add", "add_", "mul", "mul_", "neg", "cat", "silu", "to", "_to_copy", "copy_", "clone", "contiguous", "reshape",
    "view", "transpose", "unsqueeze", "slice", "select", "expand", "pow", "mean", "rsqrt", "sub", "div", "where",
    "masked_fill", "masked_fill_", "zeros", "zero_", "fill_", "empty", "empty_like", "arange", "lt", "le", "gt", "ge",
    "eq", "cos", "sin", "matmul", "bmm", "float", "detach", "alias", "index", "index_select", "stack", "sum", "exp",
    "t", "__and__", "bitwise_and", "bitwise_not", "logical_not", "repeat", "split", "chunk", "narrow")}

VIEWS = {"aten::" + op for op in ("view", "transpose", "unsqueeze", "slice", "select", "expand", "t", "alias", "detach",
                                  "narrow", "split", "chunk", "expand_as")}  # no bytes move
MAYBE_COPIES = ("aten::reshape", "aten::contiguous", "aten::to")  # a view (no child op) unless a copy was needed


@dataclass
class Group:
    us: float = 0.0  # kernel (GPU) or CPU time over all profiled calls
    ops: int = 0  # kernels (GPU) or top-level ops (CPU) over all profiled calls
    bytes: float = 0.0  # moved by its top-level ops over all profiled calls
    shapes: Counter = field(default_factory=Counter)  # GEMMs: (M, N, K) -> count over all calls
    names: Counter = field(default_factory=Counter)  # "other": the ops it holds


@dataclass
class StepProfile:
    """One step's groups, per call: ms, ops, bytes; ``total_ms`` measured apart from the groups."""
    title: str
    device: str
    groups: dict[str, Group]
    total_ms: float  # GPU: all kernels in the profile; CPU: the step ranges' wall time; per call
    replay_ms: float  # the captured graph's replay (GPU) or the eager call (CPU), timed outside the profiler
    top: list[tuple[str, int, float]]  # the busiest kernels (GPU) or ops (CPU): name, count, ms per call

    def ms(self, name: str) -> float:
        return self.groups[name].us / CALLS / 1e3 if name in self.groups else 0.0


def _label(name: str, module: nn.Module) -> str | None:
    leaf = name.rsplit(".", 1)[-1]
    if isinstance(module, nn.Linear) and leaf in GEMM_ROLES:
        return "gemm:" + GEMM_ROLES[leaf]
    if type(module).__name__.endswith("RMSNorm"):
        return "norm"
    if isinstance(module, nn.Embedding):
        return "embedding"
    return "model" if name == "" else None


@contextmanager
def annotated(model: nn.Module):
    """Every forward of ``model``'s labelled modules inside a profiler range `PART` + label."""
    handles = []
    for name, module in model.named_modules():
        label = _label(name, module)
        if label is None:
            continue
        open_ranges = []

        def enter(mod, args, label=label, open_ranges=open_ranges):
            open_ranges.append(record_function(PART + label))
            open_ranges[-1].__enter__()

        def leave(mod, args, out, open_ranges=open_ranges):
            open_ranges.pop().__exit__(None, None, None)
        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave, always_call=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _scope(event):
    """(the label of the innermost range holding ``event``, the op directly under that range)."""
    top, node = event, event.cpu_parent
    while node is not None and not node.name.startswith(PART):
        top, node = node, node.cpu_parent
    return (None if node is None else node.name[len(PART):]), top


def _group(label: str, top) -> str:
    if label.startswith("gemm:"):
        return label[len("gemm:"):] + " GEMM"
    if label in ("norm", "embedding"):
        return {"norm": "norms", "embedding": "embedding"}[label]
    if label == "step":
        return "runtime"
    if top.name == SDPA:
        return "attention (sdpa)"
    if top.name in CACHE_WRITES:
        return "cache writes"
    shapes = top.input_shapes or [[]]
    if top.name == "aten::reshape" and len(shapes[0]) == 5:  # repeat_kv: (b, g, rep, S, d) expanded, then copied
        return "K/V repeat for GQA"
    return "elementwise" if top.name in ELEMENTWISE or top.name in VIEWS else "other"


def _numel(shape) -> int:
    return math.prod(shape) if isinstance(shape, (list, tuple)) and all(isinstance(s, int) for s in shape) else 0


def _bytes_moved(group: str, top, itemsize: int) -> float:
    """Bytes ``top`` reads and writes, from its recorded input shapes."""
    shapes = [s for s in (top.input_shapes or []) if isinstance(s, list)]
    sizes = [_numel(s) for s in shapes]
    if not sizes or top.name in VIEWS or (top.name in MAYBE_COPIES and not top.cpu_children):
        return 0.0
    if group.endswith("GEMM") and len(shapes) >= 2:  # linear(x (.., K), w (N, K)): read x and w, write (M, N)
        m, n = _numel(shapes[0][:-1]), shapes[1][0]
        return itemsize * (sizes[0] + sizes[1] + m * n)
    if group == "K/V repeat for GQA":  # reads one copy of the K/V heads, writes `rep`
        return itemsize * sizes[0] * (1 + 1 / shapes[0][2])
    if group == "cache writes":  # index_copy_(buffer, dim, index, source): read and write the source's size
        return itemsize * 2 * sizes[-1]
    if group == "attention (sdpa)":  # q, k, v, mask read; the output is q's size
        return itemsize * (sum(sizes) + sizes[0])
    return itemsize * (sum(sizes) + max(sizes))


def _gemm_shape(top) -> tuple[int, int, int] | None:
    shapes = top.input_shapes or []
    if len(shapes) < 2 or not shapes[1]:
        return None
    return _numel(shapes[0][:-1]), shapes[1][0], shapes[0][-1]


def _collect(events, cuda: bool, itemsize: int) -> tuple[dict[str, Group], float]:
    """Groups over every CPU-side event under a step range, and the steps' own total (CPU)."""
    groups: dict[str, Group] = {}
    cpu_total = 0.0
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue
        if e.name == PART + "step":
            cpu_total += e.cpu_time_total
        label, top = _scope(e)
        if e.name.startswith(PART):  # a range's own time: Python between its ops
            name = "host"
        elif label is None:
            continue  # outside the profiled steps
        else:
            name = _group(label, top)
        g = groups.setdefault(name, Group())
        g.us += e.self_device_time_total if cuda else e.self_cpu_time_total
        g.ops += len(e.kernels) if cuda else int(e is top and name != "host")
        if e is top and name != "host":
            g.bytes += _bytes_moved(name, top, itemsize)
            if name.endswith("GEMM") and _gemm_shape(top):
                g.shapes[_gemm_shape(top)] += 1
            if name == "other":
                g.names[top.name] += 1
    if cuda:
        groups.pop("host", None)  # a range launches no kernel
    return groups, cpu_total


def _device_work(prof) -> list:
    """The profile's kernels, copies and memsets (a range's span on the GPU timeline is not work)."""
    return [k for k in prof.profiler.kineto_results.events()
            if k.device_type() == torch.autograd.DeviceType.CUDA and k.activity_type() in DEVICE_WORK]


def _top(prof, cuda: bool, n: int = 12) -> list[tuple[str, int, float]]:
    if cuda:
        us, count = Counter(), Counter()
        for k in _device_work(prof):
            us[k.name()[:90]] += k.duration_ns() / 1e3
            count[k.name()[:90]] += 1
        return [(name, count[name] // CALLS, t / CALLS / 1e3) for name, t in us.most_common(n)]
    ops = sorted((a for a in prof.key_averages() if not a.key.startswith(PART)), key=lambda a: -a.self_cpu_time_total)
    return [(a.key, a.count // CALLS, a.self_cpu_time_total / CALLS / 1e3) for a in ops[:n]]


def profile_call(fn, model: nn.Module, device: torch.device, title: str, replay_ms: float) -> StepProfile:
    """``fn`` `CALLS` times under the profiler, its ops grouped (see the module's docstring)."""
    cuda = device.type == "cuda"
    fn()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with annotated(model), profile(activities=activities, record_shapes=True) as prof:
        for _ in range(CALLS):
            with record_function(PART + "step"):
                fn()
        if cuda:
            torch.cuda.synchronize(device)
    itemsize = next(model.parameters()).element_size()
    groups, cpu_total = _collect(prof.events(), cuda, itemsize)
    if cuda:
        kernels = sum(k.duration_ns() / 1e3 for k in _device_work(prof))
        missing = kernels - sum(g.us for g in groups.values())
        if abs(missing) > 1e-3 * kernels:  # kernels no op of ours launched (none expected): shown, not hidden
            groups["other"] = groups.get("other", Group())
            groups["other"].us += missing
            groups["other"].names["(kernels with no op)"] += 1
        total = kernels
    else:
        total = cpu_total
    card = torch.cuda.get_device_name(device) if cuda else "CPU"
    return StepProfile(title, card, groups, total / CALLS / 1e3, replay_ms, _top(prof, cuda))


def _bound_ms(bytes_per_call: float) -> float:
    return 1e3 * bytes_per_call / BANDWIDTH


def format_profile(p: StepProfile) -> str:
    """The group table: ms per call, share, ops, bytes moved and the time at `BANDWIDTH`."""
    cuda = p.device != "CPU"
    unit = "kernels" if cuda else "ops"
    lines = [p.title, f"device: {p.device}; {CALLS} profiled eager calls of the step's function, figures per call"]
    if not cuda:
        lines.append("CPU: the times are host compute and mean nothing for a GPU; the structure and the bytes hold")
    gaps = f"; gaps between kernels: {p.replay_ms - p.total_ms:.4f} ms" if cuda else ""
    lines += [(f"{'kernel' if cuda else 'op'} time, all groups: {p.total_ms:.4f} ms; the step timed outside the "
              f"profiler ({'captured graph replay' if cuda else 'eager call'}): {p.replay_ms:.4f} ms{gaps}"), "",
              (f"{'group':<20} {unit:>7} {'ms':>9} {'share':>6} {'MB moved':>10} {'ms at 3.35TB/s':>14} "
              f"{'x bound':>8}  {'us/' + unit[:-1]:>9}  detail")]
    for name in GROUPS:
        if name not in p.groups:
            continue
        g = p.groups[name]
        ms, mb, bound = p.ms(name), g.bytes / CALLS / 1e6, _bound_ms(g.bytes / CALLS)
        ops = g.ops / CALLS
        ratio = f"{ms / bound:8.1f}" if bound > 0 else f"{'-':>8}"
        per_op = f"{1e3 * ms / ops:9.2f}" if ops else f"{'-':>9}"
        lines.append(f"{name:<20} {ops:>7.0f} {ms:>9.4f} {ms / p.total_ms:>6.1%} {mb:>10.2f} {bound:>14.4f} "
                     f"{ratio}  {per_op}  {_detail(g)}")
    mb = sum(g.bytes for g in p.groups.values()) / CALLS
    lines.append(f"{'total':<20} {sum(g.ops for g in p.groups.values()) / CALLS:>7.0f} "
                 f"{sum(p.ms(n) for n in p.groups):>9.4f} {1:>6.1%} {mb / 1e6:>10.2f} {_bound_ms(mb):>14.4f}")
    lines += ["", f"busiest {'kernels' if cuda else 'ops'}: {'count':>6} {'ms':>9}  name"]
    lines += [f"{'':<15}{count:>6} {ms:>9.4f}  {name}" for name, count, ms in p.top]
    return "\n".join(lines) + "\n"


def _detail(g: Group) -> str:
    if g.shapes:  # (M, N, K) x calls of a step
        return ", ".join(f"{m}x{n}x{k} x{count // CALLS}" for (m, n, k), count in sorted(g.shapes.items()))
    return ", ".join(f"{name} x{count // CALLS or 1}" for name, count in g.names.most_common(6))


def format_comparison(plain: StepProfile, verify: StepProfile, label: str) -> str:
    """Plain step against the verify, group by group: which grow, by how many ms."""
    cuda = plain.device != "CPU"
    unit = "kernels" if cuda else "ops"
    lines = [f"plain step vs {label}: ms per call ({'GPU kernel time' if cuda else 'CPU time: means nothing'})",
             f"{'group':<20} {'plain':>9} {'verify':>9} {'+ms':>9} {unit + ' plain':>13} {unit + ' verify':>14}"]
    for name in GROUPS:
        if name not in plain.groups and name not in verify.groups:
            continue
        a, b = plain.ms(name), verify.ms(name)
        ops = [s.groups[name].ops / CALLS if name in s.groups else 0 for s in (plain, verify)]
        lines.append(f"{name:<20} {a:>9.4f} {b:>9.4f} {b - a:>+9.4f} {ops[0]:>13.0f} {ops[1]:>14.0f}")
    lines.append(f"{'total':<20} {plain.total_ms:>9.4f} {verify.total_ms:>9.4f} {verify.total_ms - plain.total_ms:>+9.4f}")
    lines.append(f"{'timed step':<20} {plain.replay_ms:>9.4f} {verify.replay_ms:>9.4f} "
                 f"{verify.replay_ms - plain.replay_ms:>+9.4f}")
    return "\n".join(lines) + "\n"
