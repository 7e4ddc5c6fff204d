"""Generation speed of dflash-datagen's in-process generators, side by side on the same
prompts, batch size and answer length: `hf` (model.generate, left-padded batches), `engine`
(data_gen/engine.py; `engine-eager` without CUDA graphs) and optionally `hf-static`
(generate with transformers' static cache, which transformers compiles on a GPU). Prints
generated tokens/s, the GPU's idle share (a second, profiled pass over --idle-prompts: the
share of its wall time with no kernel or copy running) and how many answers equal hf's (when hf ran first).

    python benchmarks/datagen_engine.py --target PATH --prompts 1024 --batch-size 256 \\
        --max-new-tokens 512 [--kinds hf,engine,hf-static] [--jsonl prompts.jsonl]

Prompts: ShareGPT first turns (the pipeline's default source, MT-Bench and HumanEval
excluded) or a JSONL file of {"prompt": ...}, in the target's chat template, at most
--max-prompt-len tokens. Greedy unless --temperature is given. Each kind first answers
--batch-size prompts untimed (CUDA graph capture, compilation), then all of them, timed.
Runs on CPU too (tiny numbers), which is how its test runs it.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from data_gen.config import BackendConfig, SamplingConfig, to_datagen_config
from data_gen.engine import STEPS_PER_SYNC, EngineGenerator
from data_gen.hf_generator import HFGenerator
from data_gen.pipeline import setup
from dflash_train.model.target import load_target

KINDS = ("hf", "engine", "engine-eager", "hf-static")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="target spec (HF id, folder, .gguf, pkg:...)")
    p.add_argument("--jsonl", help="prompts file ({'prompt': ...} per line); default: ShareGPT first turns")
    p.add_argument("--prompts", type=int, default=1024)
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
    args = p.parse_args(argv)
    bad = [k for k in args.kinds.split(",") if k not in KINDS]
    if bad:
        p.error(f"--kinds: {bad} not in {list(KINDS)}")
    return args


def load_prompts(args, tokenizer=None):
    source = {"kind": "jsonl", "path": args.jsonl} if args.jsonl else {"kind": "sharegpt"}
    cfg = to_datagen_config({"target": {"name": args.target}, "out_dir": "unused", "sources": [source],
                             "num_prompts": args.prompts, "max_prompt_len": args.max_prompt_len})
    tokenizer, _, _, shaper, prompts, _ = setup(cfg, tokenizer)
    ids = [shaper.prompt(p.system, p.user_turns[:1], [])[0] for p in prompts]
    return ids, shaper.stop_ids, tokenizer


def build(kind: str, target, args, stop_ids: list[int], pad_id: int):
    cfg = BackendConfig(kind=kind.split("-")[0], batch_size=args.batch_size, device=args.device,
                        cuda_graphs=kind == "engine")
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    if cfg.kind == "engine":
        gen = EngineGenerator(target, cfg, sampling, stop_ids, args.max_prompt_len)
        gen.engine.sync_steps = args.sync_steps or gen.engine.sync_steps
        return gen
    gen = HFGenerator(target, cfg, sampling, stop_ids, pad_id)
    if kind == "hf-static":
        gen.kwargs["cache_implementation"] = "static"
    return gen


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(gen, prompts, seeds, device) -> tuple[list, float]:
    _sync(device)
    start = time.perf_counter()
    out = gen.generate(prompts, seeds)
    _sync(device)
    return out, time.perf_counter() - start


def idle_share(gen, prompts, seeds, device) -> str:
    """The GPU's idle share over a profiled pass: 1 - (union of kernel and copy intervals) / wall."""
    if device.type != "cuda":
        return "n/a"
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _, wall = timed(gen, prompts, seeds, device)
    spans = sorted((e.start_ns(), e.start_ns() + e.duration_ns()) for e in prof.profiler.kineto_results.events()
                   if e.device_type() == torch.autograd.DeviceType.CUDA)
    busy, end = 0, 0
    for start, stop in spans:
        busy += max(0, stop - max(start, end))
        end = max(end, stop)
    return f"{100 * (1 - busy / 1e9 / wall):.1f}% ({len(spans)} kernels)"


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts, stop_ids, tokenizer = load_prompts(args)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    target = load_target(args.target, dtype=args.dtype, device=device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    seeds = list(range(len(prompts)))
    lengths = [len(p) for p in prompts]
    print(f"{len(prompts)} prompts ({min(lengths)}-{max(lengths)} tokens, mean {sum(lengths) / len(lengths):.0f}), "
          f"batch {args.batch_size}, max_new_tokens {args.max_new_tokens}, temperature {args.temperature}, "
          f"{target.model.dtype} on {target.device} ({torch.cuda.get_device_name(target.device) if device != 'cpu' else 'CPU'})")
    print(f"{'kind':<13}{'tokens':>9}{'mean':>7}{'seconds':>9}{'tok/s':>10}{'warm-up s':>11}  "
          f"{'GPU idle':<22}{'same as hf':>10}", flush=True)
    answers = {}
    for kind in args.kinds.split(","):  # each row as soon as it is measured
        gen = build(kind, target, args, stop_ids, pad_id)
        _, warm = timed(gen, prompts[:args.batch_size], seeds[:args.batch_size], target.device)
        out, wall = timed(gen, prompts, seeds, target.device)
        answers[kind] = [c.ids for c in out]
        tokens = sum(len(ids) for ids in answers[kind])
        n = args.idle_prompts or 4 * args.batch_size
        idle = "skipped" if args.no_idle else idle_share(gen, prompts[:n], seeds[:n], target.device)
        same = (f"{sum(a == b for a, b in zip(answers[kind], answers['hf']))}/{len(prompts)}"
                if "hf" in answers else "n/a")
        print(f"{kind:<13}{tokens:>9}{tokens / len(prompts):>7.1f}{wall:>9.2f}{tokens / wall:>10.1f}{warm:>11.2f}  "
              f"{idle:<22}{same:>10}", flush=True)
        del gen  # its KV cache and graphs, before the next kind allocates its own
        if target.device.type == "cuda":
            torch.cuda.empty_cache()

if __name__ == "__main__":
    main(sys.argv[1:])
