"""Where the wall time of an engine generation goes, for `benchmarks/datagen_engine.py --profile`.

`SpanTimer` becomes the engine's timer (data_gen/engine.py calls `span(part)` around every piece
of device work the host issues, `call()` as each drain starts) and stamps both ends of each
span on the device's stream: CUDA events on a GPU, so a span's length is the device's time
from its first to its last piece of work (kernels, and any gaps between kernels inside it),
and the time between two spans is time the device had nothing queued: it waited for the
host. On CPU the host runs the work itself; the stamps are the host's clock (said so in the
table). The parts telescope: decode + prefill + copies + the gaps = the stamped wall. A gap
inside a drain is the host's scheduling, and, streamed (data_gen/turns.py feeds the engine
turn by turn), the caller's turns too; the gaps before each drain are the caller's between
calls (streamed, one drain: only its start and end). The caller's host time inside the drain
is reported beside the table.

`attention_replay` times the decode attention alone (every layer, one step, the mask built
once as in the step) on the busy rows of a representative chunk of the run, in a CUDA graph
on a GPU, and counts the KV bytes the kernel reads: `sdpa` reads `width` columns of every
row, `flex` the blocks of the live rows (data_gen/engine_attention.py).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter

import torch

from benchmarks.cuda_timing import step_seconds
from data_gen.engine_attention import DECODE_BLOCK, decode_attention, kv_blocks

PARTS = {  # table rows, in order
    "decode": "decode steps",
    "prefill": "prefill (fresh rows)",
    "prefill-kept": "prefill after a kept prefix",
    "prefill-first": "prefill, a shape's first two (once)",
    "copies": "slot copies (admission, snapshots)",
    "host": "host scheduling (device waits, in a drain)",
    "between": "between drains (the caller's calls)",
}


class SpanTimer:
    """The engine's timer: stamps on the device's stream around each span of device work."""

    def __init__(self, engine):
        self.engine, self.cuda = engine, engine.device.type == "cuda"
        engine.timer = self
        self.spans: list[tuple[str, object, object, bool]] = []  # (part, start, end, first of its call)
        self.busy: list[list[int]] = []  # per decode span: the busy rows' positions (the host's view)
        self.widths: list[int] = []  # per decode span: the width it ran at
        self.tokens: Counter = Counter()  # prompt tokens prefilled, by part
        self.fed: Counter = Counter()  # and the positions their forwards fed (rows x width: padding included)
        self.start = self.stop = None
        self._first = False

    def _stamp(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def begin(self) -> None:
        self.start = self._stamp()

    def end(self) -> None:
        self.stop = self._stamp()
        if self.cuda:
            torch.cuda.synchronize(self.engine.device)

    def call(self) -> None:
        self._first = True

    @contextlib.contextmanager
    def span(self, part: str, width: int = 0, tokens: int = 0, fed: int = 0):
        self.tokens[part] += tokens
        self.fed[part] += fed
        if part == "decode":
            e = self.engine
            self.busy.append([p for p, key in zip(e.slot_pos, e.slot_key) if key is not None])
            self.widths.append(width)
        start = self._stamp()
        yield
        self.spans.append((part, start, self._stamp(), self._first))
        self._first = False

    def parts(self) -> Counter:
        """Seconds per part; the gap before a drain's first span counts as the caller's."""
        out, previous = Counter({name: 0.0 for name in PARTS}), self.start
        for part, start, end, first in self.spans:
            out["between" if first else "host"] += self._seconds(previous, start)
            out[part] += self._seconds(start, end)
            previous = end
        out["between"] += self._seconds(previous, self.stop)
        return out

    def counts(self) -> Counter:
        return Counter(part for part, *_ in self.spans)

    def representative(self) -> tuple[list[int], int]:
        """The busy positions and width of the decode chunk of median held columns."""
        order = sorted(range(len(self.busy)), key=lambda i: sum(self.busy[i]) + len(self.busy[i]))
        i = order[len(order) // 2]
        return self.busy[i], self.widths[i]


def layer_windows(config, layers: int) -> list[int | None]:
    """Each layer's sliding window (None: full attention), as the target's attention passes it."""
    types = getattr(config, "layer_types", None) or ["full_attention"] * layers
    return [config.sliding_window if t == "sliding_attention" else None for t in types]


def kv_columns(kind: str, pos: torch.Tensor, live: torch.Tensor, width: int, length: int,
               window: int | None) -> tuple[int, int]:
    """(columns the kernel reads, columns the live rows see) of one layer's step."""
    held = torch.where(live, pos + 1 if window is None else (pos + 1).clamp(max=window), 0)
    if kind == "sdpa":
        return len(pos) * width, int(held.sum())
    count, _ = kv_blocks(pos, live, length, window)
    return int(count.sum()) * DECODE_BLOCK, int(held.sum())


def attention_replay(engine, busy: list[int], width: int, reps: int = 20) -> dict:
    """Seconds of one step's decode attention over every layer, and the KV bytes read and held,
    with the slots of `busy` live at those positions and the others finished."""
    b, dev = engine.batch_size, engine.device
    pos = torch.zeros(b, dtype=torch.long, device=dev)
    pos[:len(busy)] = torch.tensor(busy, device=dev)
    live = torch.arange(b, device=dev) < len(busy)
    k0 = engine.cache_k[0]
    hkv, length, d = k0.shape[1], k0.shape[2], k0.shape[3]
    config = engine.model.config
    groups = config.num_attention_heads // hkv
    windows = layer_windows(config, engine.layers)
    q = torch.randn(b, hkv, groups, d, dtype=k0.dtype, device=dev)

    def step():
        masks = {}
        for layer, window in enumerate(windows):
            decode_attention(engine.attention, q, engine.cache_k[layer], engine.cache_v[layer], pos, live, width,
                             window, d**-0.5, masks)

    with torch.inference_mode():
        seconds = step_seconds(step, dev, reps)
    per_token = hkv * d * 2 * k0.element_size()  # K and V of one column of one layer
    read = held = 0
    for window in windows:
        r, h = kv_columns(engine.attention, pos, live, width, length, window)
        read, held = read + r * per_token, held + h * per_token
    return {"seconds": seconds, "read_bytes": read, "held_bytes": held, "rows": len(busy),
            "mean_pos": sum(busy) / max(1, len(busy)), "width": width, "layers": len(windows)}


def table(timer: SpanTimer, wall: float, tokens: int, idle: str | None = None,
          caller: tuple[float, int] | None = None) -> list[str]:
    """The profile's lines: seconds and share of each part, the wall they sum to against the
    host's own measure, `caller` (streamed: the host seconds the turn scheduler held the
    answers handed to it, and their number), then the decode attention's bandwidth."""
    e = timer.engine
    parts, counts = timer.parts(), timer.counts()
    stamped = sum(parts.values())
    steps = counts["decode"] * e.sync_steps
    clock = "CUDA events on the device's stream" if timer.cuda else "CPU: wall timers (the host runs the device work)"
    notes = {"decode": f"{steps} steps in {counts['decode']} chunks, {tokens / max(1, steps):.1f} of "
                       f"{e.batch_size} slots live a step",
             "copies": f"{counts['copies']} spans"}
    for part in ("prefill", "prefill-kept", "prefill-first"):
        notes[part] = (f"{counts[part]} spans, {timer.tokens[part]} tokens: "
                       f"{timer.tokens[part] / max(parts[part], 1e-9):,.0f} tokens/s; fed "
                       f"{timer.fed[part]} with padding ({timer.fed[part] / max(parts[part], 1e-9):,.0f}/s)")
    lines = [f"profile ({e.attention} attention), {clock}",
             f"  {'part':<44}{'seconds':>9}{'share':>8}"]
    for key, name in PARTS.items():
        if key == "prefill-first" and e.graphs is None:  # only with prefill graphs
            continue
        lines.append(f"  {name:<44}{parts[key]:>9.3f}{100 * parts[key] / stamped:>7.1f}%  {notes.get(key, '')}")
    lines.append(f"  {'sum of the parts':<44}{stamped:>9.3f}{'':>8}  wall by the host's clock {wall:.3f} s")
    idle_s = parts["host"] + parts["between"]
    lines.append(f"  {'device idle: the wall less its spans':<44}{idle_s:>9.3f}{100 * idle_s / stamped:>7.1f}%  "
                 "the two waits above")
    if e.graphs is not None:
        c = e.prefill_counts
        lines.append(f"  prefill forwards (CUDA graphs of bucketed shapes): {c['eager']} eager (a shape's first), "
                     f"{c['captured']} captured (its second), {c['replayed']} replayed; {len(e.prefill_graphs)} graphs")
    if caller is not None:
        lines.append(f"  the caller's turns inside the drain (host clock; on a GPU the device runs meanwhile): "
                     f"{caller[0]:.3f} s for {caller[1]} answers")
    if idle not in (None, "n/a"):
        lines.append(f"  device idle at kernel level (a profiled pass, gaps between kernels included): {idle}")
    if counts["decode"]:
        a = attention_replay(e, *timer.representative())
        lines.append(f"  decode attention, a timed replay of the median chunk ({a['rows']} live rows, mean position "
                     f"{a['mean_pos']:.0f}, width {a['width']}): {1e3 * a['seconds']:.3f} ms a step over "
                     f"{a['layers']} layers")
        lines.append(f"    KV read {a['read_bytes'] / 1e6:.1f} MB a step: {a['read_bytes'] / a['seconds'] / 1e9:.1f} GB/s; "
                     f"held by the live rows {a['held_bytes'] / 1e6:.1f} MB: {a['held_bytes'] / a['seconds'] / 1e9:.1f} GB/s")
    return lines
