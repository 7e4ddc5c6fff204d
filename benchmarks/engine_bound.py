"""What the hardware allows the generation engine on a job it ran: its data set's turns replayed
through a model of the engine's slots, counting the bytes each decode step must read (the
weights, and the KV cache rows as the `sdpa` and `flex` decode attentions read them) and the
prompt tokens prefilled, then the time those take at a given bandwidth. No GPU: a bound to set
a profile against (issue 39), not a measurement.

    python -m benchmarks.engine_bound DATA_DIR                 # a dflash-datagen output folder
    python -m benchmarks.engine_bound DATA_DIR --slots 512 --bandwidth-tbs 3.0

The model of the engine (data_gen/engine.py, data_gen/turns.py): `slots` rows; a free slot takes
the next queued turn; every live slot adds one token a step; a conversation's next turn is
queued first the moment its answer ends. sdpa reads every slot's row (idle ones too) up to the
width that covers the longest live row (a multiple of `width_step`, `2 * sync_steps + 1` ahead);
flex reads each live row's blocks of `block` columns. Each turn's prompt is the whole
conversation so far (the engine of `a538aeb` prefilled it again); `kept` counts what a cache kept
between a conversation's turns prefills instead (its new user tokens; the engine does so since). Defaults: Qwen2.5-0.5B in
bf16 (24 layers, 2 KV heads of 64: 12,288 bytes a token; 0.99 GB of weights), the engine's
constants, the datagen recipe's 3,072 + 512 tokens a row.
"""

from __future__ import annotations

import argparse
import collections
import math
from dataclasses import dataclass

Turn = tuple[int, int]  # (prompt tokens: the conversation before this answer, answer tokens)


def answer_spans(loss_mask: list[int]) -> list[Turn]:
    """(start, length) of each run of 1s in a row's loss mask: a turn's prompt is everything
    before its answer."""
    spans, start = [], None
    for i, m in enumerate([*loss_mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i - start))
            start = None
    return spans


@dataclass
class Replay:
    steps: int = 0
    tokens: int = 0  # answer tokens (live slot-steps)
    sdpa_kv: int = 0  # cache positions read by sdpa, summed over steps
    flex_kv: int = 0  # ... by flex
    prefill: int = 0  # prompt tokens prefilled (each turn's whole prompt)
    prefill_kept: int = 0  # ... with the conversation's cache kept between its turns


def replay(conversations: list[list[Turn]], slots: int, width_step: int = 256, block: int = 128,
           sync_steps: int = 8, max_len: int = 3584) -> Replay:
    """Every turn of `conversations` through `slots` slots, one decode step at a time."""
    r = Replay()
    queue = collections.deque((c, 0) for c in range(len(conversations)) if conversations[c])
    busy: dict[int, list[int]] = {}  # slot -> [conversation, turn, position, tokens left]
    free = list(range(slots - 1, -1, -1))
    while queue or busy:
        while free and queue:
            c, t = queue.popleft()
            prompt, answer = conversations[c][t]
            r.prefill += prompt
            r.prefill_kept += prompt - (sum(conversations[c][t - 1]) if t else 0)
            busy[free.pop()] = [c, t, prompt, answer]
        longest = max(row[2] for row in busy.values())
        width = min(max_len, width_step * math.ceil((longest + 2 * sync_steps + 1) / width_step))
        r.sdpa_kv += slots * width
        r.flex_kv += sum(block * math.ceil((row[2] + 1) / block) for row in busy.values())
        r.steps += 1
        r.tokens += len(busy)
        for slot, row in list(busy.items()):
            row[2] += 1
            row[3] -= 1
            if row[3] == 0:
                del busy[slot]
                free.append(slot)
                c, t = row[0], row[1]
                if t + 1 < len(conversations[c]):
                    queue.appendleft((c, t + 1))
    return r


def table(r: Replay, slots: int, kv_bytes: int, weight_bytes: float, bandwidth: float, measured_s: float | None) -> str:
    decode = {name: (kv * kv_bytes + r.steps * weight_bytes) / bandwidth for name, kv in (("sdpa", r.sdpa_kv),
                                                                                        ("flex", r.flex_kv))}
    lines = [f"{r.tokens:,} answer tokens in {r.steps:,} decode steps of {slots} slots "
             f"(mean live {r.tokens / r.steps:.0f}); prompt tokens prefilled {r.prefill:,} "
             f"({r.prefill_kept:,} with each conversation's cache kept between its turns)",
             "| decode attention | KV read a step (GB) | weights a step (GB) | decode at the bandwidth (s) | tok/s bound |",
             "|---|---|---|---|---|"]
    for name, kv in (("sdpa", r.sdpa_kv), ("flex", r.flex_kv)):
        lines.append(f"| {name} | {kv * kv_bytes / r.steps / 1e9:.2f} | {weight_bytes / 1e9:.2f} | "
                     f"{decode[name]:.1f} | {r.tokens / decode[name] / 1e3:.0f}K |")
    if measured_s:
        lines.append(f"measured: {measured_s:.1f} s, {r.tokens / measured_s / 1e3:.1f}K tok/s "
                     f"({measured_s / decode['sdpa']:.1f}x sdpa's bound, {measured_s / decode['flex']:.1f}x flex's)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", help="a dflash-datagen output folder")
    parser.add_argument("--slots", type=int, default=512)
    parser.add_argument("--bandwidth-tbs", type=float, default=3.0, help="TB/s (an H100's HBM3: about 3)")
    parser.add_argument("--kv-bytes", type=int, default=12_288, help="KV cache bytes a token, all layers")
    parser.add_argument("--weights-gb", type=float, default=0.99)
    parser.add_argument("--max-len", type=int, default=3584)
    parser.add_argument("--measured-s", type=float, default=None, help="the run's answering seconds, to compare")
    args = parser.parse_args(argv)
    from dflash_train.data.format import load_generated

    ds = load_generated(args.data)
    conversations = [answer_spans(mask) for mask in ds["loss_mask"]]
    r = replay(conversations, args.slots, max_len=args.max_len)
    print(table(r, args.slots, args.kv_bytes, args.weights_gb * 1e9, args.bandwidth_tbs * 1e12, args.measured_s))


if __name__ == "__main__":
    main()
