"""What every response generator shares: its interface and the shape of its answers.
data_gen/build.py, above the generators, is the one place that picks one.

A generator turns prompt token ids into the target's response token ids: in-process
(``hf``) or through an OpenAI-compatible server (``openai``), chosen by the recipe's
``backend`` section. (Not to be confused with dflash_train.distributed's training
backends.) Both get every sampling field explicitly, so the target's own generation
defaults (a repetition penalty, a default temperature) never leak into the data unnoticed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Protocol

from data_gen.config import BackendConfig

# The hash of data generation's sampling seeds (dflash_train.contract.derive_seed).
SEED_DIGEST = "sha256"
ENGINE_BATCHES_PER_CALL = 16
# The hf generator sorts a call's prompts by length before cutting them into batches, so a
# call of several batches pads each batch only to its own longest prompt. On the
# quickstart's 512 ShareGPT prompts (batches of 32) a call of one batch pads the prompts
# to 2.6x their tokens, a shard of 64 to 1.75x, 8 batches to 1.16x. Padding costs in the
# prefill and in every decode step's attention: the first 128 of those prompts took 86,
# 75 and 66 CPU seconds (benchmarks/quickstart-cpu-2026-11-25/datagen-batching.md).
HF_BATCHES_PER_CALL = 8


@dataclass
class Completion:
    """A response: its ids end with the stop token exactly when finish_reason == 'stop'."""

    ids: list[int]
    finish_reason: str
    # False when the ids were recovered by tokenizing the server's text, not sent by it.
    exact_ids: bool = True


@dataclass
class Failure:
    """A prompt the generator could not answer. Retryable failures (server down, timeouts)
    keep their shard uncommitted so that a restart tries again."""

    detail: str
    retryable: bool


class GeneratorUnavailable(RuntimeError):
    """The generator cannot serve at all (e.g. the server is unreachable)."""


# Told (prompts, tokens) as answers of a `generate` call end, for a progress bar.
Progress = Callable[[int, int], None]


class Generator(Protocol):
    def generate(self, prompts: list[list[int]], seeds: list[int], deadline: float | None = None,
                 progress: Progress | None = None) -> list[Completion | Failure | None]:
        """Responses for `prompts`, in order. `seeds[i]` is prompt i's own sampling seed (63-bit):
        a sampled answer depends on it and the prompt only, never on the other prompts of
        the call (data_gen/sampling.py draws the numbers; greedy ignores the seeds).
        `deadline` (a time.monotonic() value, the run's budget): no prompt starts after it, and
        each prompt that did not start is None; answers already started finish. `progress`
        is called with the number of answers that just ended and their tokens."""


def past(deadline: float | None) -> bool:
    """Whether the run's budget has run out."""
    return deadline is not None and time.monotonic() >= deadline


def prompts_per_call(cfg: BackendConfig) -> int:
    """How many prompts the pipeline hands one `generate` call: enough to keep the generator
    busy, few enough that a conversation's next turn waits one call at most. (Magpie's chunks
    of candidates are sized by what they need.)"""
    if cfg.kind == "engine":
        # The turn scheduler streams the engine (data_gen/turns.py) and calls it only through
        # other schedules (magpie's chunks of candidates). Continuous batching refills a slot
        # as soon as its answer ends, but a call still waits for its slowest answer while the
        # slots empty: calls of many batches make that tail a small share of the call.
        return ENGINE_BATCHES_PER_CALL * cfg.batch_size
    if cfg.kind == "openai":
        return cfg.max_concurrency
    return HF_BATCHES_PER_CALL * cfg.batch_size


def trim_response(ids: list[int], stop_ids: list[int]) -> Completion:
    """Cut a raw continuation after its first stop token (batched generation pads after it)."""
    for i, t in enumerate(ids):
        if t in stop_ids:
            return Completion(ids[: i + 1], "stop")
    return Completion(list(ids), "length")
