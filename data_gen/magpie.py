"""Prompts written by the target itself (the Magpie method), for targets without a corpus.

The chat template is rendered up to the point where a user's message begins (system prompt
included: the source's `system_prompt`, which steers the prompts' domain as Magpie's domain
variants do, else the configured one or the template's default), and the target continues
from there: what it writes until its end-of-turn token is a user prompt in the style of its own
training chats. Each candidate i is sampled from its own seed (run seed, source name, i),
so the prompts are the same whatever the batch or the number of ranks.

Candidates are generated in chunks, each written to ``<out_dir>/prompts/<name>/`` once
complete, beside the settings that made them: a restarted run reads them back instead of
sampling again (sampled text on a GPU is not bit-stable across batch shapes, and the shard
numbering must not move). A candidate that ends without the end-of-turn token (cut at
``max_tokens``) is dropped as truncated here; empty, duplicate, eval and too-long prompts are
dropped by the common filters of sources.iter_prompts, like those of any other source.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterator

from data_gen.config import SamplingConfig, SourceConfig
from data_gen.generators import SEED_DIGEST, Failure, GeneratorUnavailable
from data_gen.template import SENTINELS, ChatShaper
from dflash_train.atomic import atomic_write_text
from dflash_train.contract import derive_seed

PROMPTS_DIR = "prompts"
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


class MagpieWriter:
    """Candidate prompts of one magpie source: read back from out_dir, or sampled and stored."""

    def __init__(self, src: SourceConfig, shaper: ChatShaper, out_dir: Path, seed: int, identity: dict,
                 generator: Callable[[SamplingConfig], object] | None, chunk: int):
        self.src, self.shaper, self.seed = src, shaper, seed
        self.folder = Path(out_dir) / PROMPTS_DIR / src.name
        self.prefix = user_prefix(shaper, src.system_prompt)
        self.prefix_ids = shaper.tokenizer(self.prefix, add_special_tokens=False)["input_ids"]
        # None: only read what another rank wrote (every chunk it needed exists by then).
        self.generator, self.chunk = generator, chunk
        source = asdict(src)
        if source["system_prompt"] is None:  # as stored before the key existed: a restart reads them back
            del source["system_prompt"]
        self.settings = {"source": source, "seed": seed, "prefix": self.prefix,
                         "target_weights": identity["weights"], "stop_token_ids": shaper.stop_ids}
        self._sampler = None

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
        if self.generator is not None:  # half-written chunks of a killed run
            for tmp in self.folder.glob(".candidates-*.tmp-*"):
                tmp.unlink(missing_ok=True)

    def _chunk_path(self, start: int) -> Path:
        return self.folder / f"candidates-{start:09d}.jsonl"

    def _sample(self, start: int, size: int) -> list[dict]:
        if self._sampler is None:
            s = self.src
            self._sampler = self.generator(SamplingConfig(max_new_tokens=s.max_tokens, temperature=s.temperature,
                                                          top_p=s.top_p, seed=self.seed))
        seeds = [derive_seed(self.seed, "magpie", self.src.name, i, digest=SEED_DIGEST)
                 for i in range(start, start + size)]
        results = self._sampler.generate([self.prefix_ids] * size, seeds)
        failed = [r.detail for r in results if isinstance(r, Failure)]
        if failed:
            raise GeneratorUnavailable(f"magpie source {self.src.name!r}: {len(failed)} prompts failed, "
                                       f"e.g. {failed[0]}")
        return [{"index": start + i, "text": self.shaper.answer_text(r.ids).strip(),
                 "finish_reason": r.finish_reason, "num_tokens": len(r.ids)} for i, r in enumerate(results)]

    def _chunk(self, start: int, remaining: int) -> list[dict] | None:
        path = self._chunk_path(start)
        if path.exists():
            return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        if self.generator is None:
            return None
        size = min(max(remaining, self.chunk), MAX_CHUNK, self.src.max_candidates - start)
        records = self._sample(start, size)
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))
        return records

    def candidates(self, remaining: Callable[[], int], skips) -> Iterator[tuple[str, str, object]]:
        """(where, "prompt", text) per usable candidate, until `remaining()` is 0 or the cap."""
        self._check_settings()
        start = 0
        while start < self.src.max_candidates and remaining() > 0:
            records = self._chunk(start, remaining())
            if records is None:
                return
            for r in records:
                if remaining() <= 0:
                    return
                where = f"{self.src.name} candidate {r['index']}"
                if r["finish_reason"] != "stop":
                    skips.add("truncated", f"{where}: no end of turn within max_tokens={self.src.max_tokens}")
                    continue
                yield where, "prompt", r["text"]
            start += len(records)
