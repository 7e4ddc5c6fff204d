"""The host's cost of reading a ShareGPT source and checking each prompt's fit (dflash-datagen's
setup before the first answer: data_gen/pipeline.py, data_gen/sources.py), on CPU, with the
target's tokenizer and chat template. Issue 39's job had its prompts ready 22-24 s after start,
11-12 s of it magpie writing and most of the rest this (the fit of 10,055 prompts checked one
tokenizer call each: 8.5 s under cProfile on an H200's host).

    python -m benchmarks.datagen_setup_cost [--tokenizer SPEC] [--prompts 5000] [--runs 3]

Rows: the source read with each prompt's first turn tokenized in its own call (`one at a time`),
and read a batch ahead with the batch's first turns tokenized in one call first (`batched`:
ChatShaper.prime, iter_prompts's `prime`; the fast tokenizer encodes a batch on every core
unless TOKENIZERS_PARALLELISM is false). Seconds are the median of --runs, each with a fresh
shaper (an empty piece cache); the prompts and their token counts must be the same both ways.
"""

from __future__ import annotations

import argparse
import os
import time

from benchmarks.turn_host_cost import DEFAULT_TOKENIZER
from data_gen.config import SHAREGPT_DEFAULT, SourceConfig
from data_gen.sources import SkipLog, iter_prompts
from data_gen.template import ChatShaper
from dflash_train.model.target import load_tokenizer, stop_token_ids

MAX_PROMPT_LEN = 3072  # issue 39's job


def run(tok, stops, n: int, batched: bool) -> tuple[float, list[tuple[str, int]], dict]:
    """(seconds, each prompt's id and first-turn tokens, skip counts) of one read of the source."""
    shaper = ChatShaper(tok, stops)
    lengths = {}

    def fits(p):
        lengths[p.prompt_id] = len(shaper.prompt_ids(p.system, p.user_turns, []))
        return ("too_long", p.prompt_id) if lengths[p.prompt_id] > MAX_PROMPT_LEN else None

    source = SourceConfig(kind="sharegpt", num_prompts=n, path=SHAREGPT_DEFAULT)
    skips = SkipLog()
    start = time.perf_counter()
    prompts = list(iter_prompts([source], set(), None, skips, fits, prime=shaper.prime if batched else None))
    seconds = time.perf_counter() - start
    return seconds, [(p.prompt_id, lengths[p.prompt_id]) for p in prompts], dict(skips.counts)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", default=DEFAULT_TOKENIZER, help="a target spec (its tokenizer and chat template)")
    p.add_argument("--prompts", type=int, default=5000, help="usable ShareGPT prompts read")
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args(argv)
    tok = load_tokenizer(args.tokenizer)
    stops = stop_token_ids(tok)
    results = {}
    for _ in range(args.runs):  # the two ways in turns: a busy host slows both
        for way in ("one at a time", "batched"):
            results.setdefault(way, []).append(run(tok, stops, args.prompts, way == "batched"))
    print(f"{args.prompts} ShareGPT prompts, {args.tokenizer}, {os.cpu_count()} CPUs, "
          f"TOKENIZERS_PARALLELISM={os.environ.get('TOKENIZERS_PARALLELISM', 'unset')}; median of {args.runs}")
    print(f"{'way':<16}{'seconds':>9}{'ms a prompt':>13}")
    for way, rs in results.items():
        s = sorted(r[0] for r in rs)[len(rs) // 2]
        print(f"{way:<16}{s:>9.2f}{1000 * s / max(1, len(rs[0][1])):>13.3f}")
    first, second = results["one at a time"][0], results["batched"][0]
    same = first[1] == second[1] and first[2] == second[2]
    print(f"prompts, tokens and skips the same both ways: {'yes' if same else 'NO'} "
          f"({len(first[1])} prompts, {sum(n for _, n in first[1])} tokens)")


if __name__ == "__main__":
    main()
