"""The host's cost of the generation engine's work, on CPU: what the device waits for while the
host issues it (issue 39: on one H200 the prefill of 2,500 tokens took 54 ms, mostly waiting).

A Qwen2 model with Qwen2.5-0.5B's structure (24 layers, 14 query heads, 2 KV heads, tied
embeddings) but tiny widths (head dim 8, a small MLP and vocabulary), so that the arithmetic is
negligible and what is timed is Python and operator dispatch, wrapped in the engine as
data_gen uses it (a TargetModel, 512 slots). Each row is the median of many repeats:

    python -m benchmarks.engine_host_cost                    # the table, then cProfile's top 15
    python -m benchmarks.engine_host_cost --repeats 50 --rows 16 --profile-top 0

  fresh prefill     one `_prefill` forward of `rows` fresh prompts (`prefill_groups`: one group)
  kept prefill      one `_prefill_after` forward of `rows` next turns after what their rows hold
  admit round       one `_admit` of rows/2 fresh prompts and rows/2 next turns (both forwards,
                    the slot bookkeeping and the slots' device state)
  harvest           one `_harvest` of a snapshot of 512 busy slots, `rows` of them finished
  decode step       one eager decode step of the 512 slots (a CUDA graph replays it on a GPU)

`aten ops`: the operators one call dispatches (each a kernel launch or more on a GPU). The
cProfile table below it is the fresh prefill forward's own time (tottime) by function.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from data_gen.config import SamplingConfig
from data_gen.engine import GenerationEngine
from dflash_train.model.target import TargetModel

# Qwen2.5-0.5B's structure; the widths are the tiny ones.
LAYERS, HEADS, KV_HEADS = 24, 14, 2
STOP = 1


def tiny_qwen(head_dim: int, intermediate: int, vocab: int, max_len: int) -> TargetModel:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=HEADS * head_dim, intermediate_size=intermediate, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=head_dim,
                         vocab_size=vocab, max_position_embeddings=max_len, tie_word_embeddings=True)
    torch.manual_seed(0)
    return TargetModel(Qwen2ForCausalLM(config).eval())


def median_ms(run, repeats: int, before=None) -> tuple[float, float]:
    """(median, min) milliseconds of run(); before() (untimed) sets each repeat up."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), min(times)


class OpCount(TorchDispatchMode):
    """Counts the operators dispatched under it: a measure of the host's work that a shared
    CPU's noise does not move."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def op_count(run, before=None) -> int:
    if before is not None:
        before()
    with OpCount() as counter:
        run()
    return counter.ops


class Bench:
    """One engine and the inputs of each timed piece."""

    def __init__(self, args):
        self.args = args
        max_len = args.fresh_tokens + args.kept_start + args.kept_new + args.max_new + 2
        self.target = tiny_qwen(args.head_dim, args.intermediate, args.vocab, max_len)
        self.engine = GenerationEngine(self.target, args.slots, max_len, SamplingConfig(max_new_tokens=args.max_new),
                                       [STOP], cuda_graphs=False)
        vocab = args.vocab
        gen = torch.Generator().manual_seed(1)
        self.words = lambda n: (torch.randint(2, vocab, (n,), generator=gen)).tolist()

    def fresh(self, n: int) -> list[tuple[int, list[int]]]:
        """(slot, prompt) of n fresh prompts of one length: one prefill group."""
        return [(slot, self.words(self.args.fresh_tokens + 1)) for slot in range(n)]

    def kept(self, n: int, first: int = 0) -> list[tuple[int, list[int], int]]:
        """(slot, tokens, start) of n next turns: kept_start tokens held, kept_new new ones."""
        a = self.args
        return [(first + i, self.words(a.kept_start + a.kept_new), a.kept_start) for i in range(n)]

    def prefills(self) -> dict:
        e, n = self.engine, self.args.rows
        fresh, kept = self.fresh(n), self.kept(n)
        return {"fresh prefill": (lambda: e._prefill(fresh, {}), None),
                "kept prefill": (lambda: e._prefill_after(kept), None)}

    def admit(self) -> tuple:
        """rows/2 fresh prompts and rows/2 next turns whose slots hold their earlier turn; the
        other slots busy."""
        e, half = self.engine, self.args.rows // 2
        fresh = [(("fresh", i), p) for i, (_, p) in enumerate(self.fresh(half))]
        turns = [(("turn", i), t + self.words(1), start) for i, (_, t, start) in enumerate(self.kept(half))]

        def before():
            e.slot_key = [("busy", s) for s in range(e.batch_size)]
            e.slot_prompt, e.kept = [None] * e.batch_size, [None] * e.batch_size
            e._slot_of.clear()
            for slot in range(half + len(turns)):  # the turns' slots first, the fresh prompts take the next
                e.slot_key[slot] = None
            for i, (key, tokens, start) in enumerate(turns):
                e.kept[i], e._slot_of[key] = (key, tokens[:start]), i
            e.queue.clear()
            for key, prompt, _ in turns:
                e.submit(key, prompt)
            for key, prompt in fresh:
                e.submit(key, prompt)

        return lambda: e._admit(None), before

    def harvest(self) -> tuple:
        """A snapshot of every slot busy, `rows` of them finished this chunk."""
        e, n = self.engine, self.args.rows
        finished = torch.zeros(e.batch_size, dtype=torch.bool)
        finished[torch.randperm(e.batch_size, generator=torch.Generator().manual_seed(2))[:n]] = True
        e.done.copy_(finished)
        e.count.fill_(self.args.max_new // 2)
        e.pos.fill_(self.args.fresh_tokens + self.args.max_new // 2)
        e.out.random_(2, self.args.vocab)
        snapshot = e._snapshot()
        stop_ids = set(e.stop_list)
        prompt = self.words(self.args.fresh_tokens + 1)

        def before():
            e._slot_of.clear()
            for slot in range(e.batch_size):
                e.slot_key[slot], e.slot_prompt[slot], e.kept[slot], e.slot_since[slot] = slot, prompt, None, 0

        return lambda: list(e._harvest(snapshot, stop_ids)), before

    def decode(self) -> tuple:
        """Every slot live."""
        e = self.engine

        def before():
            e.done.fill_(False)
            e.pos.fill_(self.args.fresh_tokens)
            e.count.zero_()

        return lambda: e._run_steps(e.max_len, 1), before

    def pieces(self) -> dict:
        return {**self.prefills(), "admit round": self.admit(), "harvest": self.harvest(),
                "decode step (eager)": self.decode()}

    def profile(self, top: int) -> str:
        e, fresh = self.engine, self.fresh(self.args.rows)
        profiler = cProfile.Profile()
        with torch.inference_mode():
            e._prefill(fresh, {})  # warm
            profiler.enable()
            for _ in range(self.args.repeats):
                e._prefill(fresh, {})
            profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
        lines = text.getvalue().splitlines()
        start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls"))
        return "\n".join(lines[start - 2:start + top + 1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--repeats", type=int, default=40, help="timed repeats of each piece (median)")
    p.add_argument("--rows", type=int, default=16, help="prompts in a prefill forward, answers in a harvest")
    p.add_argument("--slots", type=int, default=512, help="engine slots (backend.batch_size)")
    p.add_argument("--fresh-tokens", type=int, default=4, help="tokens a fresh prompt prefills")
    p.add_argument("--kept-start", type=int, default=8, help="tokens a next turn's row holds already")
    p.add_argument("--kept-new", type=int, default=4, help="tokens a next turn prefills after them")
    p.add_argument("--max-new", type=int, default=8, help="max_new_tokens of the engine")
    p.add_argument("--head-dim", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=16)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--profile-top", type=int, default=15, help="cProfile rows of the fresh prefill (0: none)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    bench = Bench(args)
    import transformers

    print(f"host cost, {LAYERS} layers, {HEADS}/{KV_HEADS} heads of {args.head_dim}, {args.slots} slots, "
          f"{args.rows} rows, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{args.threads} thread(s), median of {args.repeats}")
    print(f"{'piece':<22}{'median ms':>10}{'min ms':>9}{'aten ops':>10}")
    with torch.inference_mode():
        for name, (run, before) in bench.pieces().items():
            median, low = median_ms(run, args.repeats, before)
            print(f"{name:<22}{median:>10.2f}{low:>9.2f}{op_count(run, before):>10}", flush=True)
    if args.profile_top:
        print(f"\ncProfile of {args.repeats} fresh prefill forwards ({args.rows} rows), by own time:")
        print(bench.profile(args.profile_top))


if __name__ == "__main__":
    main()
