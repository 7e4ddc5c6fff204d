"""Prompts written by the target itself (the Magpie method), for targets without a corpus.

The chat template is rendered up to the point where a user's message begins (system prompt
included: the source's `system_prompt`, which steers the prompts' domain as Magpie's domain
variants do, else the configured one or the template's default), and the target continues
from there: what it writes until its end-of-turn token is a user prompt in the style of its own
training chats. Each candidate i is sampled from its own seed (run seed, source name, i),
so the prompts are the same whatever the batch or the number of ranks.

A candidate stops at the end of its user turn: at the ids that end an assistant turn (the
target's eos) and at every special token the template puts between two user messages' contents
(user_turn_stop_ids): the one that closes a user message when that is another (Mistral's
``[/INST]``), and those that open a turn (ChatML's ``<|im_start|>``), so a target that starts
another turn without closing its own keeps the turn it wrote and never a second one. The
same tags written as plain text pieces end it too (their text would tokenize to the tag).
A candidate is `truncated` when it did none of this within the source's ``max_tokens``: its
text is cut mid-turn, and it is dropped here, unless the source's ``keep_truncated`` keeps it
as a prompt (counted as kept, and as `cut` in the report); empty, duplicate, eval and too-long prompts are
dropped by the common filters of sources.iter_prompts, like those of any other source.
`MagpieWriter.report` counts what the writing cost: candidates written, kept, dropped by
reason, written but never needed (the last chunk's surplus), the tokens of each, and the
waste (the share of the tokens written that are not in a kept prompt).

Candidates are generated in chunks, each written to ``<out_dir>/prompts/<name>/`` once
complete, beside the settings that made them: a restarted run reads them back instead of
sampling again (sampled text on a GPU is not bit-stable across batch shapes, and the shard
numbering must not move). A run's time budget covers this writing: when it runs out, no
candidate starts, the chunk keeps the candidates written before the first one left unstarted,
and a marker file ends the source's writing for good, so every later attempt on this out_dir
reads the same prompts (the run's prompt list and shards must not move).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import asdict
from itertools import takewhile
from pathlib import Path
from typing import Callable, Iterator

from tqdm import tqdm

from data_gen.config import SamplingConfig, SourceConfig
from data_gen.generators import SEED_DIGEST, Completion, Failure, GeneratorUnavailable, past
from data_gen.sampling import SAMPLER
from data_gen.template import SENTINELS, ChatShaper
from dflash_train.atomic import atomic_write_text
from dflash_train.contract import derive_seed
from dflash_train.data.prompts import prompt_id

PROMPTS_DIR = "prompts"
# In a source's prompts folder once the run's budget ended its writing: no more candidates.
CLOSED_FILE = "closed.json"
# Candidates per chunk file: large enough to fill the generator, small enough that a kill
# loses little.
MAX_CHUNK = 4096


def user_prefix(shaper: ChatShaper, system_prompt: str | None = None) -> str:
    """The template's text up to the start of a user message's content, under
    ``system_prompt`` when given (else the run's or the template's own)."""
    messages = shaper.messages(None, [SENTINELS[0]], [])
    if system_prompt is not None:
        messages = [{"role": "system", "content": system_prompt}, *(m for m in messages if m["role"] != "system")]
    text = shaper.render(messages, add_generation_prompt=False)
    if text.count(SENTINELS[0]) != 1:
        raise ValueError("chat template: cannot find where a user message starts, so the target cannot "
                         "write prompts (magpie source)")
    return text[: text.index(SENTINELS[0])]


def user_turn_stop_ids(shaper: ChatShaper) -> list[int]:
    """Ids that end a user turn the target writes: the stop ids of an answer, then every
    special token the template puts between one user message's content and the next one's,
    in order: the tag that closes a user message when it is not an answer's stop id
    (Mistral's ``[/INST]``) and those that open a turn (ChatML's ``<|im_start|>``, Llama 3's
    ``<|start_header_id|>``). A target that opens another turn without closing its own has
    ended its user turn there, and what follows would be a second turn inside one prompt.
    A template whose turns are marked by plain text only has the stop ids."""
    users = list(SENTINELS)
    text = shaper.render(shaper.messages(None, users, ["answer"]), add_generation_prompt=False)
    between = text[text.index(users[0]) + len(users[0]): text.index(users[1])]
    added = shaper.tokenizer.added_tokens_decoder
    ids = list(shaper.stop_ids)
    for i in shaper.tokenizer(between, add_special_tokens=False)["input_ids"]:
        if i in added and added[i].special and i not in ids:
            ids.append(i)
    return ids


class MagpieWriter:
    """Candidate prompts of one magpie source: read back from out_dir, or sampled and stored.

    `generator(sampling, stop_ids)` builds the generator that writes them (None: only read
    what another rank wrote, every chunk it needed exists by then). `budget` (the run's, or
    None) gives the deadline after which no candidate starts, and is saved after each chunk;
    `progress` shows a bar per chunk of candidates. A chunk holds the candidates the prompts
    still missing need (`_needed`), at most MAX_CHUNK: no more, even when that leaves slots of
    the generator idle (a chunk's wall time is its longest candidate's, a few candidates'
    about a full batch's, and the surplus of a full batch was a fifth of the tokens written on
    issue 39's job)."""

    def __init__(self, src: SourceConfig, shaper: ChatShaper, out_dir: Path, seed: int, identity: dict,
                 generator: Callable[[SamplingConfig, list[int]], object] | None, budget=None,
                 progress: bool = False, ranks: tuple[int, int] = (0, 1), barrier: Callable[[], None] | None = None):
        self.src, self.shaper, self.seed = src, shaper, seed
        # (rank, world size) of ranks that write every chunk together, each a slice of it, meeting
        # at `barrier` (an unbudgeted run on several ranks); (0, 1): this process writes alone.
        self.rank, self.world = ranks
        self.barrier = barrier
        if self.world > 1 and (barrier is None or budget is not None):
            raise ValueError("magpie: ranks share the writing only without a budget, and need a barrier")
        self.folder = Path(out_dir) / PROMPTS_DIR / src.name
        self.prefix = user_prefix(shaper, src.system_prompt)
        self.prefix_ids = shaper.tokenizer(self.prefix, add_special_tokens=False)["input_ids"]
        self.stop_ids = user_turn_stop_ids(shaper)
        self.stop_tags = [shaper.tokenizer.decode([i]) for i in self.stop_ids]
        self.generator = generator
        self.budget, self.progress = budget, progress
        source = asdict(src)
        for key, default in (("system_prompt", None), ("keep_truncated", False)):
            if source[key] == default:  # as stored before the key existed: a restart reads them back
                del source[key]
        # The sampler: a candidate's seed gives another prompt under another one (v1 folders are
        # refused rather than finished with v2's candidates).
        self.settings = {"source": source, "seed": seed, "prefix": self.prefix, "sampler": SAMPLER,
                         "target_weights": identity["weights"], "stop_token_ids": self.stop_ids}
        self._sampler = None
        self.read: list[dict] = []  # the candidates handed on or dropped, in order
        self.seconds = 0.0  # writing candidates (the first call's compile and capture included)

    def _check_settings(self) -> None:
        path = self.folder / "settings.json"
        if path.exists():
            previous = json.loads(path.read_text())
            for key in sorted(set(previous) | set(self.settings)):
                if previous.get(key) != self.settings.get(key):
                    raise ValueError(f"{str(self.folder)!r} holds prompts made with {key}={previous.get(key)!r}, "
                                     f"this run has {key}={self.settings.get(key)!r}: use a new out_dir or the "
                                     "original settings")
        elif self.generator is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps(self.settings, indent=2, sort_keys=True))
        if self.generator is not None and self.rank == 0:  # half-written chunks of a killed run
            for tmp in [*self.folder.glob(".candidates-*.tmp-*"), *self.folder.glob(".candidates-*.part-*")]:
                tmp.unlink(missing_ok=True)
        if self.world > 1:  # no rank writes before rank 0 has cleared the folder
            self.barrier()

    def _chunk_path(self, start: int) -> Path:
        return self.folder / f"candidates-{start:09d}.jsonl"

    @property
    def closed(self) -> bool:
        """Whether the run's budget ended this source's writing (in this or an earlier attempt)."""
        return (self.folder / CLOSED_FILE).exists()

    def _close(self, written: int) -> None:
        atomic_write_text(self.folder / CLOSED_FILE, json.dumps({"candidates": written, "reason": "budget"}))

    def _record(self, index: int, r: Completion) -> dict:
        # A candidate that ended its turn ends with a stop id (Completion's rule): not text.
        ids = r.ids[:-1] if r.finish_reason == "stop" else r.ids
        text, finish = self.shaper.tokenizer.decode(ids, skip_special_tokens=False), r.finish_reason
        # A stop tag spelled in pieces decodes to the tag's text, which the template would
        # tokenize as the tag itself: the turn ends there too.
        found = [text.index(tag) for tag in self.stop_tags if tag in text]
        if found:
            text, finish = text[:min(found)], "stop"
        return {"index": index, "text": text.strip(), "finish_reason": finish, "num_tokens": len(r.ids)}

    def _sample(self, start: int, size: int, kept: int) -> list[dict]:
        """Candidates start..start+size-1, or those of them written before the budget ran out."""
        if self._sampler is None:
            s = self.src
            self._sampler = self.generator(SamplingConfig(max_new_tokens=s.max_tokens, temperature=s.temperature,
                                                          top_p=s.top_p, seed=self.seed), self.stop_ids)
        seeds = [derive_seed(self.seed, "magpie", self.src.name, i, digest=SEED_DIGEST)
                 for i in range(start, start + size)]
        bar = tqdm(total=size, unit="candidate", desc=f"magpie {self.src.name} {start}-{start + size - 1}",
                   disable=not self.progress)
        began, tokens = time.perf_counter(), [0]

        def progress(n: int, t: int) -> None:
            tokens[0] += t
            bar.update(n)
            bar.set_postfix_str(f"{tokens[0] / (time.perf_counter() - began):.0f} tok/s, {kept} of "
                                f"{self.src.num_prompts} prompts kept before this chunk", refresh=False)

        try:
            results = self._sampler.generate([self.prefix_ids] * size, seeds,
                                             None if self.budget is None else self.budget.deadline, progress)
        finally:
            bar.close()
            self.seconds += time.perf_counter() - began
        failed = [r.detail for r in results if isinstance(r, Failure)]
        if failed:
            raise GeneratorUnavailable(f"magpie source {self.src.name!r}: {len(failed)} prompts failed, "
                                       f"e.g. {failed[0]}")
        # Candidates start in order, so those the budget left unstarted (None) are the last.
        return [self._record(start + i, r) for i, r in enumerate(takewhile(lambda r: r is not None, results))]

    def _out_of_time(self) -> bool:
        return self.budget is not None and past(self.budget.deadline)

    def _chunk(self, start: int, remaining: int) -> list[dict] | None:
        path = self._chunk_path(start)
        if path.exists():
            return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        if self.generator is None or self.closed:
            return None
        if self._out_of_time():
            self._close(start)
            return None
        size = self._size(start, remaining)
        if self.world > 1:
            return self._shared_chunk(start, size, self.src.num_prompts - remaining)
        records = self._sample(start, size, self.src.num_prompts - remaining)
        if self.budget is not None:  # first: a kill between the two then counts the seconds
            self.budget.save()
        if records:
            atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))
        if len(records) < size:
            self._close(start + len(records))
        return records or None

    def _shared_chunk(self, start: int, size: int, kept: int) -> list[dict]:
        """The chunk at `start` written by every rank: rank r samples the r-th slice of its
        candidates into a part file, rank 0 joins the parts into the chunk file, every rank
        reads it back. Each candidate has its own seed, so the chunk holds what one process
        would write; no budget here, so every candidate is written."""
        path, per = self._chunk_path(start), -(-size // self.world)
        lo = start + self.rank * per
        mine = self._sample(lo, min(per, start + size - lo), kept) if lo < start + size else []
        part = self.folder / f".candidates-{start:09d}.part-{self.rank}"
        atomic_write_text(part, "".join(json.dumps({**r, "rank": self.rank}) + "\n" for r in mine))
        self.barrier()
        if self.rank == 0:
            parts = [self.folder / f".candidates-{start:09d}.part-{r}" for r in range(self.world)]
            atomic_write_text(path, "".join(p.read_text(encoding="utf-8") for p in parts))
            for p in parts:
                p.unlink()
        self.barrier()
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]

    def _usable(self, r: dict) -> bool:
        return r["finish_reason"] == "stop" or self.src.keep_truncated

    def _size(self, start: int, remaining: int) -> int:
        """Candidates the chunk at `start` writes for `remaining` more prompts."""
        return min(self._needed(remaining), MAX_CHUNK, self.src.max_candidates - start)

    def _needed(self, remaining: int) -> int:
        """Candidates to write for `remaining` more prompts: at the share of the candidates read
        so far that were usable, with a tenth more (duplicates and filters drop some). Only the
        chunk's size moves: each candidate comes from its own seed."""
        usable = sum(map(self._usable, self.read))
        if not usable:
            return remaining
        return -(-remaining * len(self.read) * 11 // (10 * usable))

    def candidates(self, remaining: Callable[[], int], skips) -> Iterator[tuple[str, str, object]]:
        """(where, "prompt", text) per usable candidate, until `remaining()` is 0 or the cap."""
        self._check_settings()
        start = 0
        while start < self.src.max_candidates and remaining() > 0:
            records = self._chunk(start, remaining())
            if records is None:
                return
            # each candidate's fit is checked in turn: its tokens first, all of the chunk's in one call
            self.shaper.prime([(None, r["text"]) for r in records if self._usable(r)])
            for r in records:
                if remaining() <= 0:
                    return
                self.read.append(r)
                where = f"{self.src.name} candidate {r['index']}"
                if not self._usable(r):
                    skips.add("truncated", f"{where}: no end of its user turn within max_tokens={self.src.max_tokens}",
                              source=self.src.name)
                    continue
                yield where, "prompt", r["text"]
            start += len(records)

    def _stored(self) -> list[dict]:
        records = []
        for path in sorted(self.folder.glob("candidates-*.jsonl")):
            records += [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        return records

    def report(self, kept_ids: set[str], dropped: Counter) -> dict:
        """What the source's prompts cost, once the prompts are read: candidates written (by any
        attempt), kept as prompts (`kept_ids`: the prompt ids taken), dropped by reason, unused
        (written, never needed), the tokens the target wrote for each group (the dropped ones'
        also for the truncated alone), and the waste: the share of all tokens written that are
        not in a kept prompt."""
        stored = self._stored()
        claimed: set[str] = set()
        kept_tokens = 0
        for r in self.read:  # a duplicate's first copy is the one taken
            pid = prompt_id(r["text"]) if self._usable(r) else None
            if pid in kept_ids and pid not in claimed:
                claimed.add(pid)
                kept_tokens += r["num_tokens"]
        read_tokens = sum(r["num_tokens"] for r in self.read)
        tokens = sum(r["num_tokens"] for r in stored)
        return {"candidates": len(stored), "kept": len(claimed), "dropped": dict(sorted(dropped.items())),
                "unused": len(stored) - len(self.read), "tokens": tokens, "tokens_kept": kept_tokens,
                "tokens_dropped": read_tokens - kept_tokens,
                "tokens_truncated": sum(r["num_tokens"] for r in self.read if not self._usable(r)),
                **({"cut": sum(r["finish_reason"] != "stop" for r in self.read)} if self.src.keep_truncated else {}),
                "tokens_unused": tokens - read_tokens,
                "waste": round((tokens - kept_tokens) / tokens, 4) if tokens else 0.0,
                "stopped_by_budget": self.closed}
