"""The data-generation run: prompts -> shards of target-written conversations -> dataset.

Prompts are numbered after filtering and cut into fixed shards of `shard_size`; shard k
belongs to rank k % world_size. A shard's content depends only on its prompts and the
settings (sampling seeds derive from (seed, shard, turn)), so a restart, or a run with a
different number of ranks, writes the same rows.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

from tqdm import tqdm

from data_gen.config import DatagenConfig
from data_gen.generators import (
    SEED_DIGEST,
    Failure,
    GeneratorUnavailable,
    build_generator,
)
from data_gen.sources import SkipLog, SourcePrompt, eval_hashes, iter_prompts
from data_gen.template import ChatShaper
from dflash_train.contract import derive_seed
from dflash_train.data import format as data_format
from dflash_train.errors import check_writable_dir
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


@dataclass
class _Conversation:
    prompt: SourcePrompt
    answers: list[list[int]] = field(default_factory=list)
    # The last completed turn: (prompt ids, prompt mask, response ids, finish reason).
    row: tuple | None = None
    ended: bool = False


@dataclass
class RunResult:
    out_dir: str
    counts: dict
    tokens_per_s: float
    generated_tokens: int
    elapsed_s: float
    complete: bool


def _dist():
    """(rank, world size, local rank) from the launcher (torchrun sets these)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=BARRIER_TIMEOUT)
    return int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0"))


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


def setup(cfg: DatagenConfig, tokenizer=None):
    """Tokenizer, chat shaper and the usable prompts (with load-time skips counted)."""
    tokenizer = tokenizer or load_tokenizer(cfg.target.name, cfg.cache_dir)
    identity = target_identity(cfg.target.name, cfg.cache_dir)
    # Before any template override: the target's own tokenizer.
    tok_ident = {"tokenizer": tokenizer_identity(tokenizer), "tokenizer_hash": tokenizer_hash(tokenizer)}
    stop_ids = stop_token_ids(tokenizer, _generation_config(cfg.target.name, cfg.cache_dir))
    if not stop_ids:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no eos token: cannot tell where a turn ends")
    t = cfg.template
    shaper = ChatShaper(tokenizer, stop_ids, t.enable_thinking, t.system_prompt, t.chat_template)
    skips = SkipLog()
    prompts = []
    for p in iter_prompts(cfg.sources, eval_hashes(cfg.exclude_eval), t.max_turns, skips):
        try:
            ids, _ = shaper.prompt(p.system, p.user_turns, [])
        except Exception as e:  # a template raising (jinja `raise_exception`, odd roles): skip it
            skips.add("template_error", f"{p.source} {p.prompt_id}: {type(e).__name__}: {e}")
            continue
        if len(ids) > cfg.max_prompt_len:
            skips.add("too_long", f"{p.source} {p.prompt_id}: {len(ids)} tokens > max_prompt_len={cfg.max_prompt_len}")
            continue
        prompts.append(p)
        if cfg.num_prompts is not None and len(prompts) == cfg.num_prompts:
            break
    return tokenizer, identity, tok_ident, shaper, prompts, skips


def _fingerprint(cfg: DatagenConfig, identity: dict, tok_ident: dict, shaper: ChatShaper, prompts) -> dict:
    ids = hashlib.sha256(json.dumps([p.prompt_id for p in prompts]).encode()).hexdigest()[:16]
    # By content: a restart may name the same weights by another path.
    return {"target": {"weights": identity["weights"]}, "tokenizer": tok_ident["tokenizer"],
            "template": {**shaper.settings, "max_turns": cfg.template.max_turns}, "sampling": asdict(cfg.sampling),
            "max_prompt_len": cfg.max_prompt_len, "shard_size": cfg.shard_size, "num_prompts": len(prompts),
            "prompts_sha256": ids, "backend": cfg.backend.kind}


def _next_prompt(shaper: ChatShaper, conv: _Conversation, max_len: int):
    """Prompt (ids, mask) for the conversation's next turn, or the reason it ends here."""
    try:
        ids, mask = shaper.prompt(conv.prompt.system, conv.prompt.user_turns, conv.answers)
    except Exception as e:  # see setup(): a later turn the template refuses ends the conversation
        return f"template_error: {type(e).__name__}"
    return (ids, mask) if len(ids) <= max_len else "too_long"


def _row(conv: _Conversation) -> dict:
    """The training row of a conversation: its last prompt plus the target's last answer."""
    ids, mask, response, finish = conv.row
    return {"input_ids": ids + response, "loss_mask": mask + [1] * len(response), "prompt_id": conv.prompt.prompt_id,
            "source": conv.prompt.source, "finish_reason": finish, "prompt_len": len(ids),
            "response_len": len(response), "num_tokens": len(ids) + len(response)}


def generate_shard(cfg: DatagenConfig, shaper: ChatShaper, generator, prompts: list[SourcePrompt], index: int):
    """Rows and metadata of one shard; raises GeneratorUnavailable on retryable failures."""
    convs = [_Conversation(p) for p in prompts]
    skips, ended, tokens, retokenized = SkipLog(), SkipLog(), 0, 0
    for turn in range(max(len(p.user_turns) for p in prompts)):
        batch = []
        for c in convs:
            if c.ended or turn >= len(c.prompt.user_turns):
                continue
            nxt = _next_prompt(shaper, c, cfg.max_prompt_len)
            if isinstance(nxt, str):
                c.ended = True
                ended.add(nxt)
            else:
                batch.append((c, nxt))
        if not batch:
            break
        results = generator.generate([ids for _, (ids, _) in batch],
                                     derive_seed(cfg.sampling.seed, index, turn, digest=SEED_DIGEST))
        retry = [r.detail for r in results if isinstance(r, Failure) and r.retryable]
        if retry:
            raise GeneratorUnavailable(f"shard {index}: {len(retry)} prompts failed, e.g. {retry[0]}")
        for (c, (ids, mask)), r in zip(batch, results):
            if isinstance(r, Failure):
                c.ended = True
                (skips if c.row is None else ended).add("backend_error", f"{c.prompt.prompt_id}: {r.detail}")
                continue
            tokens += len(r.ids)
            retokenized += not r.exact_ids
            c.answers.append(r.ids)
            c.row = (ids, mask, r.ids, r.finish_reason)
            # A cut-off answer is not a history the target would continue from.
            c.ended = r.finish_reason != "stop"
    rows = [_row(c) for c in convs if c.row is not None]
    meta = {"shard": index, "prompt_ids": [p.prompt_id for p in prompts], "generated_tokens": tokens,
            "retokenized": retokenized, "skipped": dict(skips.counts), "skipped_examples": skips.examples,
            "ended_early": dict(ended.counts), "finish_reasons": dict(Counter(r["finish_reason"] for r in rows)),
            "rows": len(rows), "tokens": sum(r["num_tokens"] for r in rows),
            "response_tokens": sum(r["response_len"] for r in rows)}
    return rows, meta


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
    return {"prompts": len(prompts), **counts, "finish_reasons": dict(finish), "ended_early": dict(ended),
            "skipped": dict(skips.counts), "skipped_examples": skips.examples}


def run(cfg: DatagenConfig, target=None, tokenizer=None, progress: bool = True) -> RunResult:
    """Generate (or finish generating) the dataset of `cfg` into cfg.out_dir.

    `target` and `tokenizer` reuse an already loaded target (tests, notebooks)."""
    rank, world, local_rank = _dist()
    out = Path(cfg.out_dir)
    # Before the target loads: a user's folder, or one that cannot be written, fails now.
    data_format.check_out_dir(out)
    check_writable_dir(out, "out_dir")
    tokenizer, identity, tok_ident, shaper, prompts, load_skips = setup(cfg, tokenizer)
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
    mine = [k for k in range(rank, num_shards, world) if data_format.read_shard_meta(out, k) is None]
    started, generated = time.perf_counter(), 0
    if mine:
        generator = build_generator(cfg.backend, cfg.sampling, cfg.target.name, shaper.stop_ids,
                                    _pad_id(tokenizer, shaper), tokenizer, local_rank, cfg.target.dtype, cfg.cache_dir,
                                    target)
        started = time.perf_counter()
        bar = tqdm(total=sum(len(prompts[k * cfg.shard_size:(k + 1) * cfg.shard_size]) for k in mine),
                   unit="prompt", disable=not progress or rank != 0, desc=f"rank {rank}")
        try:
            for k in mine:
                shard_prompts = prompts[k * cfg.shard_size:(k + 1) * cfg.shard_size]
                rows, meta = generate_shard(cfg, shaper, generator, shard_prompts, k)
                data_format.write_shard(out, k, rows, {**meta, "rank": rank})
                generated += meta["generated_tokens"]
                bar.update(len(shard_prompts))
                bar.set_postfix_str(f"{generated / (time.perf_counter() - started):.1f} tok/s")
        finally:
            bar.close()  # ends the bar's line, so an error message starts on its own
    elapsed = time.perf_counter() - started
    _barrier(world)
    metas = [data_format.read_shard_meta(out, k) for k in range(num_shards)]
    counts = _counts(prompts, load_skips, [m for m in metas if m is not None])
    complete = all(m is not None for m in metas)
    if rank == 0 and complete and counts["rows"] and not (out / "manifest.json").exists():
        manifest = {"format_version": data_format.FORMAT_VERSION, "target": identity, **tok_ident,
                    "template": fingerprint["template"], "sampling": asdict(cfg.sampling),
                    "max_prompt_len": cfg.max_prompt_len, "sources": [asdict(s) for s in cfg.sources],
                    "exclude_eval": cfg.exclude_eval, "backend": _backend_settings(cfg),
                    "num_shards": num_shards, "counts": counts}
        data_format.consolidate(out, num_shards, manifest)
    _barrier(world)
    return RunResult(str(out), counts, generated / elapsed if elapsed > 0 else 0.0, generated, elapsed, complete)


def _backend_settings(cfg: DatagenConfig) -> dict:
    settings = asdict(cfg.backend)
    settings.pop("api_key")  # a credential, not a property of the data
    return settings


def _pad_id(tokenizer, shaper: ChatShaper) -> int:
    # Left padding is masked out, so any id works; pad == eos is common (SmolLM2).
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else shaper.stop_ids[0]
