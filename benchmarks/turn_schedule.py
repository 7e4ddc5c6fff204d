"""The every-turn job's schedule without a GPU: how many decode steps the engine's slots take, and
how full they are, when the pipeline's own turn scheduler (data_gen/turns.py) feeds them.

The job is issue 39's (`benchmarks/datagen_engine_gpu.sh`): ShareGPT conversations answered turn
by turn, each turn's prompt built by the real chat shaper from the target's tokenizer and
template; single-turn prompts stand in for the magpie ones (first turns of the conversations
after them, one for each conversation, interleaved). The target's answers are replaced by the
corpus's own assistant replies, tokenized (cut at max_new_tokens: a cut answer ends its
conversation, as a `length` finish does). A model of the engine (data_gen/engine.py's `_loop`)
answers them: `slots` rows, every live row one token a step, the host reading the slots every
`sync_steps` steps one chunk behind, a free slot taking the next queued turn at once.

    python -m benchmarks.turn_schedule --target /tmp/qwen25coder05b.gguf --conversations 2000 --single 2000

Prints the decode steps against the ideal (answer tokens / slots), the mean live slots, the
prompt tokens prefilled (and after what the slot of a conversation's last answer holds, as the
engine prefills when the next turn takes that slot: the model counts every such turn), and the
steps by which the last shards finish. A model, not a measurement: no prefill time, no GPU.
"""

from __future__ import annotations

import argparse
import time
from collections import deque

from data_gen.engine import shared_prefix
from data_gen.generators import Completion


class SlotModel:
    """A streaming generator (`wanted`, `submit`, `drain`, `unstarted`) whose answers come
    from `answer(key, prompt)` and whose timing is counted in decode steps."""

    streams = True

    def __init__(self, slots: int, sync_steps: int, answer):
        # [key, completion, emitted, admission number, prompt + answer]
        self.rows: list[list | None] = [None] * slots
        self.queue: deque = deque()
        self.sync_steps, self.answer = sync_steps, answer
        self.steps = self.live = self.prefill = self.prefill_kept = self.admitted = self.answers = 0
        self.held: dict = {}  # key -> the tokens its last answer's row holds (data_gen/engine.py)

    def wanted(self) -> int:
        return max(0, self.rows.count(None) - len(self.queue))

    def submit(self, key, prompt, seed) -> None:
        self.queue.append((key, prompt))

    def unstarted(self) -> list:
        keys = [k for k, _ in self.queue]
        self.queue.clear()
        return keys

    def _chunk(self) -> list[tuple[int, object]]:
        for _ in range(self.sync_steps):
            self.steps += 1
            for row in self.rows:
                if row is not None and row[2] < len(row[1].ids):
                    row[2] += 1
                    self.live += 1
        return [(i, row[3]) for i, row in enumerate(self.rows) if row is not None and row[2] >= len(row[1].ids)]

    def drain(self, deadline=None):
        pending = None
        while True:
            snapshot = self._chunk() if any(r is not None for r in self.rows) else None
            if pending is not None:
                for slot, admission in pending:
                    row = self.rows[slot]
                    if row is not None and row[3] == admission:  # not admitted after the snapshot
                        self.rows[slot] = None
                        self.answers += 1
                        self.held[row[0]] = row[4][:len(row[4]) - 2]
                        yield row[0], row[1]
            for slot in range(len(self.rows)):
                if self.rows[slot] is None and self.queue:
                    key, prompt = self.queue.popleft()
                    self.prefill += len(prompt) - 1
                    self.prefill_kept += len(prompt) - 1 - shared_prefix(self.held.pop(key, []), prompt[:-1])
                    self.admitted += 1
                    answer = self.answer(key, prompt)
                    self.rows[slot] = [key, answer, 0, self.admitted, prompt + answer.ids]
            if snapshot is None and all(r is None for r in self.rows):
                return
            pending = snapshot


def corpus_replies(src) -> dict[str, list[str]]:
    """Each ShareGPT conversation's assistant replies by the prompt id the pipeline gives it."""
    from data_gen.sources import READERS, SkipLog
    from dflash_train.data.prompts import chat_messages, prompt_id

    replies = {}
    for _, _, turns in READERS["sharegpt"](src, SkipLog()):
        try:
            messages = chat_messages(turns, "")
        except Exception:  # the pipeline skips it too
            continue
        users = [m["content"] for m in messages if m["role"] == "user"]
        if users and users[0].strip():
            replies.setdefault(prompt_id(users[0]), [m["content"] for m in messages if m["role"] == "assistant"])
    return replies


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="the target whose tokenizer and template build the prompts")
    p.add_argument("--conversations", type=int, default=2000)
    p.add_argument("--single", type=int, default=2000, help="single-turn prompts (the magpie ones' stand-ins)")
    p.add_argument("--slots", type=int, default=512)
    p.add_argument("--sync-steps", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--max-prompt-len", type=int, default=3072)
    p.add_argument("--shard-size", type=int, default=64)
    p.add_argument("--lookahead", type=int, default=None,
                   help="conversations kept open (data_gen/turns.py; default the pipeline's call size)")
    args = p.parse_args(argv)

    from data_gen.config import to_datagen_config
    from data_gen.generators import prompts_per_call
    from data_gen.pipeline import load_tokenizer, setup
    from data_gen.sources import SourcePrompt
    from data_gen.turns import generate_shards

    tokenizer = load_tokenizer(args.target, None)
    cfg = to_datagen_config({
        "target": {"name": args.target}, "out_dir": "/tmp/turn-schedule", "shard_size": args.shard_size,
        "sources": [{"kind": "sharegpt", "num_prompts": args.conversations + args.single}],
        "max_prompt_len": args.max_prompt_len, "template": {"max_turns": None},
        "sampling": {"max_new_tokens": args.max_new_tokens}, "backend": {"kind": "engine", "batch_size": args.slots}})
    _, _, _, shaper, prompts, _ = setup(cfg, tokenizer)
    replies = corpus_replies(cfg.sources[0])
    convs, singles = prompts[:args.conversations], prompts[args.conversations:]
    singles = [SourcePrompt(s.prompt_id, "single", s.system, s.user_turns[:1]) for s in singles]
    job = [x for pair in zip(convs, singles) for x in pair] + convs[len(singles):] + singles[len(convs):]
    shards = {k: job[i:i + cfg.shard_size] for k, i in enumerate(range(0, len(job), cfg.shard_size))}
    stop = shaper.stop_ids[0]
    turns: dict = {}
    encoded: dict = {}

    def answer(key, prompt) -> Completion:
        conv = shards[key[0]][key[1]]
        t = turns[key] = turns.get(key, -1) + 1
        if (conv.prompt_id, t) not in encoded:
            texts = replies.get(conv.prompt_id, [])
            text = texts[t] if t < len(texts) else (texts[-1] if texts else "ok")
            encoded[conv.prompt_id, t] = tokenizer.encode(text, add_special_tokens=False)
        ids = encoded[conv.prompt_id, t] + [stop]
        if len(ids) > args.max_new_tokens:
            return Completion(ids[:args.max_new_tokens], "length")
        return Completion(ids, "stop")

    model = SlotModel(args.slots, args.sync_steps, answer)
    started = time.perf_counter()
    tokens, shard_end = 0, {}
    for k, _, meta in generate_shards(cfg, shaper, model, shards, prompts_per_call(cfg.backend),
                                      lookahead=args.lookahead):
        tokens += meta["generated_tokens"]
        shard_end[k] = model.steps
    ideal = tokens / args.slots
    ends = sorted(shard_end.values())
    print(f"{len(job)} prompts ({len(convs)} conversations, {len(singles)} single turns) in {len(shards)} shards "
          f"of {cfg.shard_size}, {args.slots} slots, chunks of {args.sync_steps} steps "
          f"(modelled in {time.perf_counter() - started:.0f} s)")
    print("| answers | answer tokens | decode steps | ideal (tokens / slots) | steps / ideal | mean live slots "
          "| prompt tokens prefilled (with the slot's cache kept) | half the shards done at step "
          "| last shard done at step |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {model.answers:,} | {tokens:,} | {model.steps:,} | {ideal:,.0f} | {model.steps / ideal:.2f} "
          f"| {model.live / model.steps:.0f} | {model.prefill:,} ({model.prefill_kept:,}) | {ends[len(ends) // 2]:,} | {ends[-1]:,} |")


if __name__ == "__main__":
    main()
