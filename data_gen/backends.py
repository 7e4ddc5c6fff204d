"""The generation interface the pipeline talks to, and the one place that picks a backend.

A backend turns prompt token ids into the target's response token ids. Both backends get
every sampling field explicitly, so the target's own generation defaults (a repetition
penalty, a default temperature) never leak into the data unnoticed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol

from data_gen.config import BackendConfig, SamplingConfig


@dataclass
class Completion:
    """A response: its ids end with the stop token exactly when finish_reason == 'stop'."""

    ids: list[int]
    finish_reason: str
    # False when the ids were recovered by tokenizing the server's text, not sent by it.
    exact_ids: bool = True


@dataclass
class Failure:
    """A prompt the backend could not answer. Retryable failures (server down, timeouts)
    keep their shard uncommitted so that a restart tries again."""

    detail: str
    retryable: bool


class BackendUnavailable(RuntimeError):
    """The backend cannot serve at all (e.g. the server is unreachable)."""


class Backend(Protocol):
    def generate(self, prompts: list[list[int]], seed: int) -> list[Completion | Failure]:
        """Responses for `prompts`, in order; `seed` makes sampled output reproducible."""


def derive_seed(*parts) -> int:
    """A 63-bit seed from (run seed, shard, turn, batch, ...): stable across runs and ranks."""
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def trim_response(ids: list[int], stop_ids: list[int]) -> Completion:
    """Cut a raw continuation after its first stop token (batched generation pads after it)."""
    for i, t in enumerate(ids):
        if t in stop_ids:
            return Completion(ids[: i + 1], "stop")
    return Completion(list(ids), "length")


def build_backend(cfg: BackendConfig, sampling: SamplingConfig, target_spec: str, stop_ids: list[int],
                  pad_id: int, tokenizer, local_rank: int = 0, dtype: str = "auto", cache_dir: str | None = None,
                  target=None):
    """The configured backend; `target` reuses an already loaded TargetModel (hf only)."""
    if cfg.kind == "hf":
        from data_gen.hf_backend import HFBackend

        if target is not None:
            return HFBackend(target, cfg, sampling, stop_ids, pad_id)
        return HFBackend.load(target_spec, cfg, sampling, stop_ids, pad_id, local_rank=local_rank, dtype=dtype,
                              cache_dir=cache_dir)
    from data_gen.openai_backend import OpenAIBackend

    return OpenAIBackend(cfg, sampling, stop_ids, tokenizer, model_name=cfg.model or target_spec)
