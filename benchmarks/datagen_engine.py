"""Generation speed of dflash-datagen's in-process generators, side by side on the same
prompts, batch size and answer length: `hf` (model.generate, left-padded batches), `engine`
(data_gen/engine.py, SDPA decode attention; `engine-flex` with backend.attention=flex,
`engine-flex-compiled` with its decode step compiled too (backend.compile, a decoder layer at a
time; `engine-flex-compiled-model` the whole forward, backend.compile_region=model); `engine-eager`
without CUDA graphs; a kind ending in `-packed` with the fresh prompts packed in rows,
backend.prefill=packed) and optionally `hf-static` (generate with transformers'
static cache, which transformers compiles on a GPU). Prints generated tokens/s, the GPU's idle
share (a second, profiled pass over --idle-prompts first turns: the share of its wall time
with no kernel or copy running) and how many rows equal those of the first kind listed (on a
GPU in bf16 the agreement rate of two kernels; in float32 on CPU all of them).

    python -m benchmarks.datagen_engine --target PATH --prompts 1024 --batch-size 256 \\
        --max-new-tokens 512 [--kinds hf,engine,engine-flex,hf-static] [--jsonl prompts.jsonl] \\
        [--all-turns] [--magpie N] [--profile]

Prompts: ShareGPT conversations (the pipeline's default source, MT-Bench and HumanEval
excluded) or a JSONL file ({"prompt": ...} or {"messages": [...]}), in the target's chat
template, at most --max-prompt-len tokens; --magpie N adds N prompts the target writes itself
(written once, before the kinds run, and not timed). They go through the pipeline's own
scheduling (data_gen/turns.py), as dflash-datagen hands them over (the engine streamed, a
conversation's next turn queued as its answer ends; hf in calls): first turns only, or with
--all-turns every turn, each on the target's own earlier answers.
The issue-39 job (`--config-name datagen_all_turns`, 5,000 conversations and 5,000 magpie
prompts): --all-turns --prompts 5000 --magpie 5000 --max-prompt-len 3072 --batch-size 512
--max-new-tokens 512; the magpie candidates cut at --magpie-tokens are kept as the recipe keeps
them (keep_truncated; --drop-truncated drops them, as the profile of `a538aeb` did: 71% of
the magpie tokens wasted). Greedy unless --temperature is given. Each kind first answers
--batch-size first turns untimed (CUDA graph capture, compilation), then the job, timed.
--profile adds, for each engine kind, where the timed pass's wall time went
(benchmarks/engine_profile.py): decode, prefill, copies, host scheduling, the time between
drains, the caller's time inside the drain, and the decode attention's bandwidth. Runs on CPU
too (tiny numbers), which is how its tests run it.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from collections import Counter

import torch

from benchmarks.engine_profile import SpanTimer, table
from data_gen.config import BackendConfig, SamplingConfig, to_datagen_config
from data_gen.engine import STEPS_PER_SYNC, EngineGenerator
from data_gen.generators import prompts_per_call
from data_gen.hf_generator import HFGenerator
from data_gen.pipeline import Generators, pad_token_id, setup
from data_gen.turns import generate_shards
from dflash_train.model.target import load_target, load_tokenizer

KINDS = ("hf", "engine", "engine-flex", "engine-flex-compiled", "engine-eager", "hf-static", "engine-packed",
         "engine-flex-packed", "engine-flex-compiled-packed", "engine-flex-compiled-model-packed")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="target spec (HF id, folder, .gguf, pkg:...)")
    p.add_argument("--jsonl", help="prompts file ({'prompt': ...} or {'messages': [...]} per line); default: ShareGPT")
    p.add_argument("--prompts", type=int, default=1024, help="conversations (prompts) of the file or ShareGPT")
    p.add_argument("--all-turns", action="store_true", help="every user turn, each on the earlier answers")
    p.add_argument("--magpie", type=int, default=0, help="add this many prompts written by the target")
    p.add_argument("--magpie-tokens", type=int, default=256, help="the longest prompt the target may write")
    p.add_argument("--drop-truncated", action="store_true",
                   help="drop a magpie candidate cut at --magpie-tokens (the recipes keep it: keep_truncated)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--max-prompt-len", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--kinds", default="hf,engine")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--sync-steps", type=int, default=None,
                   help=f"engine: decode steps per chunk (default {STEPS_PER_SYNC} on CUDA, 1 on CPU)")
    p.add_argument("--idle-prompts", type=int, default=None,
                   help="prompts of the profiled pass (default 4 x batch size: a trace of every kernel is large)")
    p.add_argument("--no-idle", action="store_true", help="skip the profiled pass")
    p.add_argument("--profile", action="store_true", help="engine kinds: where the timed pass's wall time went")
    args = p.parse_args(argv)
    bad = [k for k in args.kinds.split(",") if k not in KINDS]
    if bad:
        p.error(f"--kinds: {bad} not in {list(KINDS)}")
    if args.profile and not any(k.startswith("engine") for k in args.kinds.split(",")):
        p.error(f"--profile: it profiles the engine kinds, and --kinds={args.kinds} has none")
    return args


def job_config(args, out_dir: str):
    """The datagen config of the job: its sources, turns, prompt length and sampling."""
    first = {"kind": "jsonl", "path": args.jsonl} if args.jsonl else {"kind": "sharegpt"}
    sources, num_prompts = [first], args.prompts
    if args.magpie:  # the count applies to the corpus alone
        first["num_prompts"], num_prompts = args.prompts, None
        sources.append({"kind": "magpie", "num_prompts": args.magpie, "max_tokens": args.magpie_tokens,
                        "keep_truncated": not args.drop_truncated})
    return to_datagen_config({
        "target": {"name": args.target, "dtype": args.dtype}, "out_dir": out_dir, "sources": sources,
        "num_prompts": num_prompts, "max_prompt_len": args.max_prompt_len,
        "template": {"max_turns": None if args.all_turns else 1},
        "sampling": {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature},
        "backend": {"batch_size": args.batch_size, "device": args.device, "cpu_threads": args.threads}})


def load_job(args, target, tokenizer, out_dir: str):
    """(config, chat shaper, prompts, magpie line or None): the prompts the pipeline would
    answer, magpie ones written by the target now (with the engine on a GPU)."""
    cfg = job_config(args, out_dir)
    started = time.perf_counter()
    _, _, _, shaper, prompts, skips = setup(cfg, tokenizer, Generators(cfg, tokenizer, target=target))
    magpie = skips.reports.get("magpie")
    line = None if magpie is None else (
        f"magpie: {magpie['kept']} prompts kept of {magpie['candidates']} candidates ({magpie['dropped']} dropped), "
        f"{100 * magpie['waste']:.1f}% of their {magpie['tokens']} tokens wasted, written in "
        f"{time.perf_counter() - started:.1f} s (not timed below)")
    return cfg, shaper, prompts, line


def build(kind: str, target, args, stop_ids: list[int], pad_id: int):
    cfg = BackendConfig(kind=kind.split("-")[0], batch_size=args.batch_size, device=args.device,
                        cuda_graphs=kind != "engine-eager", attention="flex" if "flex" in kind else "sdpa",
                        sync_steps=args.sync_steps if kind.startswith("engine") else None,
                        compile=kind.startswith("engine-flex-compiled"),
                        compile_region="model" if "-compiled-model" in kind else "layer",
                        prefill="packed" if kind.endswith("-packed") else "padded")
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    if cfg.kind == "engine":
        gen = EngineGenerator(target, cfg, sampling, stop_ids, args.max_prompt_len)
        return gen, cfg
    gen = HFGenerator(target, cfg, sampling, stop_ids, pad_id)
    if kind == "hf-static":
        gen.kwargs["cache_implementation"] = "static"
    return gen, cfg


class Counting:
    """A generator that counts the prompts (turns) it was asked and the answers it gave, in
    calls or streamed as the engine is; streamed, also the host seconds the caller (the turn
    scheduler: recording an answer, queueing the next turn) held the answers handed to it."""

    def __init__(self, gen):
        self.gen, self.asked, self.answered = gen, 0, 0
        self.streams = getattr(gen, "streams", False)
        self.caller_s = 0.0

    def generate(self, prompts, seeds, deadline=None, progress=None):
        out = self.gen.generate(prompts, seeds, deadline, progress)
        self.asked += len(prompts)
        self.answered += sum(r is not None for r in out)
        return out

    def wanted(self) -> int:
        return self.gen.wanted()

    def submit(self, key, prompt, seed) -> None:
        self.gen.submit(key, prompt, seed)
        self.asked += 1

    def drain(self, deadline=None):
        for item in self.gen.drain(deadline):
            self.answered += 1
            start = time.perf_counter()
            yield item
            self.caller_s += time.perf_counter() - start

    def unstarted(self) -> list:
        return self.gen.unstarted()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_job(cfg, shaper, prompts, gen, backend: BackendConfig):
    """Every turn of the job through the pipeline's scheduling (the engine streamed, hf in
    calls): (rows by prompt id, answer tokens, the counting generator)."""
    counting = Counting(gen)
    shards = {k: prompts[i:i + cfg.shard_size] for k, i in enumerate(range(0, len(prompts), cfg.shard_size))}
    rows, tokens = {}, 0
    for _, shard_rows, meta in generate_shards(cfg, shaper, counting, shards, prompts_per_call(backend)):
        rows.update((r["prompt_id"], r["input_ids"]) for r in shard_rows)
        tokens += meta["generated_tokens"]
    return rows, tokens, counting


def timed(fn, device):
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - start


def idle_share(gen, prompts, seeds, device) -> tuple[str, list[str]]:
    """The GPU's idle share over a profiled pass: 1 - (union of kernel and copy intervals) / wall,
    and the pass's kernels by device time (kernel_table)."""
    if device.type != "cuda":
        return "n/a", []
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _, wall = timed(lambda: gen.generate(prompts, seeds), device)
    events = [(e.name(), e.start_ns(), e.duration_ns()) for e in prof.profiler.kineto_results.events()
              if e.device_type() == torch.autograd.DeviceType.CUDA]
    busy, end = 0, 0
    for _, start, length in sorted(events, key=lambda e: e[1]):
        busy += max(0, start + length - max(start, end))
        end = max(end, start + length)
    return f"{100 * (1 - busy / 1e9 / wall):.1f}% ({len(events)} kernels)", kernel_table(events, wall)


def kernel_table(events: list[tuple[str, int, int]], wall: float, top: int = 14) -> list[str]:
    """The profiled pass's kernels (name, start ns, duration ns) summed by name, the `top`
    longest: device seconds, share of the pass's wall, launches, mean microseconds a launch
    (a name cut at 70 characters; templated kernels differ past there only in their arguments)."""
    total, count = Counter(), Counter()
    for name, _, length in events:
        total[name[:70]] += length
        count[name[:70]] += 1
    lines = [f"  kernels of the profiled pass, by device time (wall {wall:.2f} s)",
             f"  {'kernel':<72}{'seconds':>8}{'share':>7}{'launches':>10}{'us each':>9}"]
    for name, ns in total.most_common(top):
        lines.append(f"  {name:<72}{ns / 1e9:>8.3f}{100 * ns / 1e9 / wall:>6.1f}%{count[name]:>10}"
                     f"{ns / 1e3 / count[name]:>9.1f}")
    rest = sum(total.values()) - sum(ns for _, ns in total.most_common(top))
    lines.append(f"  {'the other ' + str(max(0, len(total) - top)) + ' kernels':<72}{rest / 1e9:>8.3f}"
                 f"{100 * rest / 1e9 / wall:>6.1f}%")
    return lines


def run_kind(kind, target, args, job, first_turns, pad_id, answers) -> list[str]:
    """Warm up, time the job, and the kind's table row (with the profile's lines under it)."""
    cfg, shaper, prompts = job
    gen, backend = build(kind, target, args, shaper.stop_ids, pad_id)
    seeds = list(range(len(first_turns)))
    _, warm = timed(lambda: gen.generate(first_turns[:args.batch_size], seeds[:args.batch_size]), target.device)
    timer = SpanTimer(gen.engine) if args.profile and backend.kind == "engine" else None
    if timer is not None:
        timer.begin()
    (rows, tokens, counting), wall = timed(lambda: run_job(cfg, shaper, prompts, gen, backend), target.device)
    asked, answered = counting.asked, counting.answered
    if timer is not None:
        timer.end()
        gen.engine.timer = None  # the idle pass below runs untimed
    first = answers.setdefault("first", rows)  # the first kind's rows: the others are compared with them
    n = args.idle_prompts or 4 * args.batch_size
    idle, kernels = ("skipped", []) if args.no_idle else idle_share(gen, first_turns[:n], seeds[:n], target.device)
    same = f"{sum(rows.get(k) == v for k, v in first.items())}/{len(first)}"
    lines = [f"{kind:<13}{tokens:>9}{tokens / max(1, asked):>7.1f}{wall:>9.2f}{tokens / wall:>10.1f}{warm:>11.2f}  "
             f"{idle:<22}{same:>11}{asked:>8}{answered:>10}{len(rows):>6}"]
    if timer is not None:
        lines += table(timer, wall, tokens, None if args.no_idle else idle,
                       (counting.caller_s, counting.answered) if counting.streams else None)
    return lines + kernels


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    target = load_target(args.target, dtype=args.dtype, device=device)
    tokenizer = load_tokenizer(args.target)
    with tempfile.TemporaryDirectory() as out_dir:  # magpie's candidate files
        cfg, shaper, prompts, magpie = load_job(args, target, tokenizer, out_dir)
    gc.collect()  # the magpie writer's engine (its KV cache) before the kinds allocate theirs
    if target.device.type == "cuda":
        torch.cuda.empty_cache()
    first_turns = [shaper.prompt(p.system, p.user_turns[:1], [])[0] for p in prompts]
    pad_id = pad_token_id(tokenizer, shaper)
    lengths = [len(p) for p in first_turns]
    turns = sum(len(p.user_turns) for p in prompts)
    print(f"{len(prompts)} prompts ({min(lengths)}-{max(lengths)} tokens, mean {sum(lengths) / len(lengths):.0f}; "
          f"{turns} user turns, {'every turn' if args.all_turns else 'first turns'}), "
          f"batch {args.batch_size}, max_new_tokens {args.max_new_tokens}, temperature {args.temperature}, "
          f"{target.model.dtype} on {target.device} ({torch.cuda.get_device_name(target.device) if device != 'cpu' else 'CPU'})")
    if magpie:
        print(magpie)
    print(f"{'kind':<13}{'tokens':>9}{'mean':>7}{'seconds':>9}{'tok/s':>10}{'warm-up s':>11}  "
          f"{'GPU idle':<22}{'same as 1st':>11}{'turns':>8}{'answered':>10}{'rows':>6}", flush=True)
    answers = {}
    for kind in args.kinds.split(","):  # each row as soon as it is measured
        print("\n".join(run_kind(kind, target, args, (cfg, shaper, prompts), first_turns, pad_id, answers)),
              flush=True)
        if target.device.type == "cuda":  # the kind's KV cache and graphs, before the next allocates its own
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
