"""The data-generation run: prompts -> shards of target-written conversations -> dataset.

Prompts are numbered after filtering and cut into fixed shards of `shard_size`; shard k
belongs to rank k % world_size. A shard's content depends only on its prompts and the
settings (each prompt samples from its own seed, derived from (seed, prompt id, turn)), so a
restart, or a run with a different number of ranks, writes the same rows. data_gen/turns.py
schedules the turns of a rank's conversations; magpie sources (prompts written by the
target, data_gen/magpie.py) are written before the prompts are numbered, a slice of each chunk
by every rank (by rank 0 alone under a time budget).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

from tqdm import tqdm

from data_gen.config import DatagenConfig, SamplingConfig
from data_gen.build import build_generator
from data_gen.generators import past, prompts_per_call
from data_gen.inputs import check_inputs
from data_gen.magpie import MagpieWriter
from data_gen.sampling import SAMPLER
from data_gen.sources import SkipLog, SourcePrompt, eval_hashes, iter_prompts
from data_gen.template import ChatShaper
from data_gen.turns import generate_shards
from dflash_train.data import format as data_format
from dflash_train.distributed.launch import launch_env
from dflash_train.atomic import atomic_write_text
from dflash_train.model.target import (
    load_tokenizer,
    resolve_target,
    stop_token_ids,
    target_identity,
    tokenizer_hash,
    tokenizer_identity,
)

# Ranks that finish their shards early wait for the others at a barrier; a crashed rank
# makes torchrun stop the whole group, so a long timeout only covers uneven shards.
BARRIER_TIMEOUT = timedelta(hours=24)


BUDGET_FILE = "budget.json"  # the seconds a budgeted run has spent after loading, over attempts


@dataclass
class RunResult:
    out_dir: str
    counts: dict
    tokens_per_s: float
    generated_tokens: int
    elapsed_s: float
    complete: bool
    # The budget ran out first: the dataset holds the shards begun (manifest "budget").
    budget_reached: bool = False
    unstarted: int = 0  # prompts never answered because of the budget
    # This rank's seconds from the start of run() to its prompts (sources read, magpie prompts
    # written) and, of elapsed_s, to its answering generator built (target loaded, engine set up)
    # and writing its shards (while the engine decodes nothing new: its host is writing)
    prompts_s: float = 0.0
    build_s: float = 0.0
    write_s: float = 0.0
    # Loading the target (in prompts_s where a magpie writer's generator loaded it, else in
    # build_s) and, of prompts_s, writing magpie candidates (the first call's compile included)
    load_s: float = 0.0
    magpie_s: float = 0.0


class Budget:
    """budget_min of the stage after loading (writing magpie prompts, then answering) over every
    attempt: the seconds spent are kept in <out_dir>/budget.json (rank 0 writes it; every
    rank reads it before it starts). The clock starts when the target is loaded: ``start``,
    called once the first generator is built."""

    def __init__(self, out: Path, minutes: float, rank: int):
        self.path, self.rank = out / BUDGET_FILE, rank
        self.minutes = minutes
        self.spent = json.loads(self.path.read_text())["seconds"] if self.path.exists() else 0.0
        self.started = time.monotonic()
        self.running = False

    def start(self) -> None:
        """Start the clock (the first call of an attempt only)."""
        if not self.running:
            self.started, self.running = time.monotonic(), True

    @property
    def left(self) -> float:
        return self.minutes * 60 - self.spent

    @property
    def deadline(self) -> float:
        return (self.started if self.running else time.monotonic()) + self.left

    def save(self) -> None:
        if self.rank == 0:
            seconds = self.spent + (time.monotonic() - self.started if self.running else 0.0)
            atomic_write_text(self.path, json.dumps({"seconds": round(seconds, 3), "minutes": self.minutes}))


def _dist():
    """(rank, world size, local rank) from the launcher (torchrun sets these)."""
    env = launch_env()
    if env.world_size > 1:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=BARRIER_TIMEOUT)
        import torch

        # The rank's GPU the current device: what runs on the current device without naming one
        # (pinned buffers' context, streams, torch.cuda.graph's capture stream and synchronize)
        # would otherwise go to GPU 0, beside rank 0's work.
        if torch.cuda.is_available() and env.local_rank < torch.cuda.device_count():
            torch.cuda.set_device(env.local_rank)
    return env.rank, env.world_size, env.local_rank


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def _generation_config(spec: str, cache_dir):
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(resolve_target(spec, cache_dir))
    except OSError:  # no generation_config.json: the tokenizer's eos is the stop token
        return None


class Generators:
    """Builds generators of any sampling settings on first use, sharing one loaded target
    (magpie prompts and the answers use the same weights); the first one built starts the
    run's budget, if any (loading the target is not the budget's)."""

    def __init__(self, cfg: DatagenConfig, tokenizer, local_rank: int = 0, target=None, budget=None):
        self.cfg, self.tokenizer, self.local_rank, self.target = cfg, tokenizer, local_rank, target
        self.budget = budget
        self.load_s = 0.0  # seconds loading the target (the build that had none)
        self.magpie_s = 0.0  # seconds the magpie writers' generators took (setup adds them)

    def build(self, sampling: SamplingConfig, shaper: ChatShaper, stop_ids: list[int] | None = None):
        """A generator of `sampling` that stops at `stop_ids` (None: the end of an answer).

        Every engine of a run holds rows of one length, max_prompt_len and the most new tokens
        any of them writes (the answers' or a magpie source's): the engine's compiled decode
        forward depends on that shape alone, so the magpie writer's and the answers' share it
        (data_gen/engine.py; each compiled on its own, 33 s more on a machine's first run)."""
        cfg = self.cfg
        most_new = max([cfg.sampling.max_new_tokens] + [s.max_tokens for s in cfg.sources if s.kind == "magpie"])
        rows = cfg.max_prompt_len + most_new - sampling.max_new_tokens  # the engine adds sampling.max_new_tokens
        began = time.perf_counter()
        loads = self.target is None
        gen = build_generator(cfg.backend, sampling, cfg.target.name, stop_ids or shaper.stop_ids,
                              pad_token_id(self.tokenizer, shaper), self.tokenizer, self.local_rank, cfg.target.dtype,
                              cfg.cache_dir, self.target, rows)
        self.target = getattr(gen, "target", self.target)
        if loads and self.target is not None:
            self.load_s += time.perf_counter() - began
        if self.budget is not None:
            self.budget.start()
        return gen


def setup(cfg: DatagenConfig, tokenizer=None, generators: Generators | None = None, progress: bool = False,
          ranks: tuple[int, int] = (0, 1)):
    """Tokenizer, chat shaper and the usable prompts (with load-time skips counted, and the
    magpie sources' reports in ``skips.reports``).

    Magpie sources sample their prompts with `generators` (within its budget, if any);
    without it they only read the prompts an earlier run or rank 0 wrote into out_dir.
    `ranks` (rank, world size) with a world of several: every rank calls this at once, and
    they write each chunk of candidates together (an unbudgeted run)."""
    tokenizer = tokenizer or load_tokenizer(cfg.target.name, cfg.cache_dir)
    identity = target_identity(cfg.target.name, cfg.cache_dir)
    # Before any template override: the target's own tokenizer.
    tok_ident = {"tokenizer": tokenizer_identity(tokenizer), "tokenizer_hash": tokenizer_hash(tokenizer)}
    stop_ids = stop_token_ids(tokenizer, _generation_config(cfg.target.name, cfg.cache_dir))
    if not stop_ids:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no eos token: cannot tell where a turn ends")
    t = cfg.template
    shaper = ChatShaper(tokenizer, stop_ids, t.enable_thinking, t.system_prompt, t.chat_template)

    def fits(p: SourcePrompt) -> tuple[str, str] | None:
        try:
            ids = shaper.prompt_ids(p.system, p.user_turns, [])  # its length alone: no loss mask
        except Exception as e:  # a template raising (jinja `raise_exception`, odd roles): skip it
            return "template_error", f"{p.source} {p.prompt_id}: {type(e).__name__}: {e}"
        if len(ids) > cfg.max_prompt_len:
            return "too_long", f"{p.source} {p.prompt_id}: {len(ids)} tokens > max_prompt_len={cfg.max_prompt_len}"
        return None

    writers = []

    def magpie(src, skips, remaining):
        build = None if generators is None else lambda sampling, stops: generators.build(sampling, shaper, stops)
        writer = MagpieWriter(src, shaper, Path(cfg.out_dir), cfg.sampling.seed, identity, build,
                              None if generators is None else generators.budget, progress, ranks,
                              lambda: _barrier(ranks[1]))
        writers.append(writer)
        return writer.candidates(remaining, skips)

    skips = SkipLog()
    # the file sources' prompts checked a batch at a time (one call of the tokenizer), magpie's a chunk
    prompts = list(iter_prompts(cfg.sources, eval_hashes(cfg.exclude_eval), t.max_turns, skips, fits,
                                {"magpie": magpie}, limit=cfg.num_prompts, prime=shaper.prime))
    for w in writers:
        kept = {p.prompt_id for p in prompts if p.source == w.src.name}
        skips.reports[w.src.name] = w.report(kept, skips.by_source.get(w.src.name, Counter()))
        if generators is not None:
            generators.magpie_s += w.seconds
    return tokenizer, identity, tok_ident, shaper, interleave(prompts), skips


def interleave(prompts: list[SourcePrompt]) -> list[SourcePrompt]:
    """The prompts of every source mixed in proportion to their counts, each source's in its
    order: the next prompt is from the source that has handed out the smallest share of its own
    (the first source on a tie). Prompts start in this order, so a budget that ends a run cuts
    every source alike instead of the last ones (5,000 ShareGPT conversations then 5,000 magpie
    prompts, 6 minutes on one H100 at temperature 0.7: the magpie prompts never started)."""
    queues: dict[str, list[SourcePrompt]] = {}
    for p in prompts:
        queues.setdefault(p.source, []).append(p)
    rank = {source: i for i, source in enumerate(queues)}  # the sources' order: ties go to the first
    taken = dict.fromkeys(queues, 0)
    out = []
    for _ in prompts:
        source = min(queues, key=lambda s: (taken[s] / len(queues[s]), rank[s]))
        out.append(queues[source][taken[source]])
        taken[source] += 1
    return out


def _fingerprint(cfg: DatagenConfig, identity: dict, tok_ident: dict, shaper: ChatShaper, prompts) -> dict:
    ids = hashlib.sha256(json.dumps([p.prompt_id for p in prompts]).encode()).hexdigest()[:16]
    # By content: a restart may name the same weights by another path.
    fingerprint = {"target": {"weights": identity["weights"]}, "tokenizer": tok_ident["tokenizer"],
                   "template": {**shaper.settings, "max_turns": cfg.template.max_turns},
                   "sampling": asdict(cfg.sampling), "max_prompt_len": cfg.max_prompt_len,
                   "shard_size": cfg.shard_size, "num_prompts": len(prompts), "prompts_sha256": ids,
                   "backend": cfg.backend.kind}
    if not cfg.sampling.greedy:  # a run started with the older per-batch seeds must not be finished with these
        fingerprint["sampler"] = SAMPLER
    return fingerprint


def _counts(prompts, load_skips: SkipLog, metas: list[dict]) -> dict:
    """Run totals: load-time skips (recounted each run) plus what every shard recorded."""
    skips = SkipLog()
    skips.merge(load_skips.counts, load_skips.examples)
    finish, ended = Counter(), Counter()
    for m in metas:
        skips.merge(m["skipped"], m["skipped_examples"])
        finish.update(m["finish_reasons"])
        ended.update(m["ended_early"])
    counts = {key: sum(m[key] for m in metas) for key in ("rows", "tokens", "response_tokens", "retokenized")}
    counts = {"prompts": len(prompts), **counts, "finish_reasons": dict(finish), "ended_early": dict(ended),
              "skipped": dict(skips.counts), "skipped_examples": skips.examples}
    if load_skips.reports:
        counts["magpie"] = load_skips.reports
    return counts


def run(cfg: DatagenConfig, target=None, tokenizer=None, progress: bool = True) -> RunResult:
    """Generate (or finish generating) the dataset of `cfg` into cfg.out_dir.

    `target` and `tokenizer` reuse an already loaded target (tests, notebooks)."""
    began = time.perf_counter()
    rank, world, local_rank = _dist()
    out = Path(cfg.out_dir)
    check_inputs(cfg)  # before the target loads: a user's folder or a missing file fails now
    tokenizer = tokenizer or load_tokenizer(cfg.target.name, cfg.cache_dir)
    finished = (out / "manifest.json").exists()  # a dataset written: nothing more to generate
    budgeted = cfg.budget_min is not None and not finished
    generators = Generators(cfg, tokenizer, local_rank, target)
    if budgeted and rank == 0:
        generators.budget = Budget(out, cfg.budget_min, rank)
    # Magpie prompts: without a budget every rank writes a slice of each chunk of candidates
    # (and loads its target meanwhile); with one, rank 0 writes them within it first and the
    # other ranks then read them. A finished run only reads them.
    together = world > 1 and not budgeted and not finished
    if rank == 0 or together:
        tokenizer, identity, tok_ident, shaper, prompts, load_skips = setup(
            cfg, tokenizer, None if finished else generators, progress and rank == 0,
            (rank, world) if together else (0, 1))
    _barrier(world)
    if rank != 0 and not together:
        tokenizer, identity, tok_ident, shaper, prompts, load_skips = setup(cfg, tokenizer)
        if budgeted:  # read after rank 0 wrote the seconds its magpie prompts took
            generators.budget = Budget(out, cfg.budget_min, rank)
    prompts_s = time.perf_counter() - began
    if not prompts:
        raise ValueError(f"no usable prompts in sources {[s.name for s in cfg.sources]}: "
                         f"skipped {dict(load_skips.counts)}")
    fingerprint = _fingerprint(cfg, identity, tok_ident, shaper, prompts)
    if rank == 0:
        data_format.check_run(out, fingerprint)
        data_format.remove_stale_temps(out)
    _barrier(world)
    if rank != 0:
        data_format.check_run(out, fingerprint)
    num_shards = math.ceil(len(prompts) / cfg.shard_size)

    def shard(k: int) -> list[SourcePrompt]:
        return prompts[k * cfg.shard_size:(k + 1) * cfg.shard_size]

    mine = {k: shard(k) for k in range(rank, num_shards, world)
            if not finished and data_format.read_shard_meta(out, k) is None}
    budget = generators.budget
    _barrier(world)  # every rank has read budget.json before rank 0 writes it again
    started, generated, build_s, write_s = time.perf_counter(), 0, 0.0, 0.0
    if mine and (budget is None or not past(budget.deadline)):
        generated, build_s, write_s = _generate(cfg, shaper, generators, mine, out, rank, budget, progress)
    elapsed = time.perf_counter() - started
    _barrier(world)
    metas = [data_format.read_shard_meta(out, k) for k in range(num_shards)]
    counts = _counts(prompts, load_skips, [m for m in metas if m is not None])
    complete = all(m is not None for m in metas)
    committed = [k for k, m in enumerate(metas) if m is not None]
    unstarted = sum(len(shard(k)) for k, m in enumerate(metas) if m is None) + counts["skipped"].get("budget", 0)
    # Here with shards left (every rank is past the barrier, none failed), a budgeted run
    # stopped because its budget ran out, on this rank or another; or it cut turns of
    # shards that were all open.
    reached = budget is not None and (not complete or any("budget_cut" in m for m in metas if m is not None))
    if rank == 0 and (complete or reached) and counts["rows"] and not finished:
        manifest = {"format_version": data_format.FORMAT_VERSION, "target": identity, **tok_ident,
                    "template": fingerprint["template"], "sampling": asdict(cfg.sampling),
                    "max_prompt_len": cfg.max_prompt_len, "sources": [asdict(s) for s in cfg.sources],
                    "exclude_eval": cfg.exclude_eval, "backend": _backend_settings(cfg),
                    "num_shards": num_shards, "counts": counts}
        if budget is not None:
            manifest["budget"] = {"minutes": cfg.budget_min, "reached": reached, "shards": len(committed),
                                  "of": num_shards, "prompts_unstarted": unstarted}
        data_format.consolidate(out, committed, manifest)
    if finished:
        recorded = data_format.read_manifest(out).get("budget", {})
        reached, unstarted = recorded.get("reached", False), recorded.get("prompts_unstarted", 0)
    _barrier(world)
    return RunResult(str(out), counts, generated / elapsed if elapsed > 0 else 0.0, generated, elapsed, complete,
                     reached, unstarted if reached else 0, prompts_s, build_s, write_s, generators.load_s,
                     generators.magpie_s)


def _generate(cfg: DatagenConfig, shaper: ChatShaper, generators: Generators, mine: dict, out: Path, rank: int,
              budget: Budget | None, progress: bool) -> tuple[int, float, float]:
    """Answer this rank's shards, committing each as it completes (or as the budget ends
    it); the generated token count, the seconds building the generator took and those writing
    the shards."""
    began = time.perf_counter()
    generator = generators.build(cfg.sampling, shaper)  # starts the budget, unless magpie writing did
    started, generated, write_s = time.perf_counter(), 0, 0.0
    bar = tqdm(total=sum(map(len, mine.values())), unit="prompt", disable=not progress or rank != 0,
               desc=f"rank {rank}")
    try:
        for k, rows, meta in generate_shards(cfg, shaper, generator, mine, prompts_per_call(cfg.backend),
                                             None if budget is None else budget.deadline):
            if budget is not None:  # first: a kill between the two then counts the seconds
                budget.save()
            writing = time.perf_counter()
            data_format.write_shard(out, k, rows, {**meta, "rank": rank})
            write_s += time.perf_counter() - writing
            generated += meta["generated_tokens"]
            bar.update(len(mine[k]))
            bar.set_postfix_str(f"{generated / (time.perf_counter() - started):.1f} tok/s")
    finally:
        bar.close()  # ends the bar's line, so an error message starts on its own
        if budget is not None:
            budget.save()
    return generated, started - began, write_s


def _backend_settings(cfg: DatagenConfig) -> dict:
    settings = asdict(cfg.backend)
    settings.pop("api_key")  # a credential, not a property of the data
    return settings


def pad_token_id(tokenizer, shaper: ChatShaper) -> int:
    # Left padding is masked out, so any id works; pad == eos is common (SmolLM2).
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else shaper.stop_ids[0]
