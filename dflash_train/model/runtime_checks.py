"""The runtime's setting checks without torch, for the commands that validate before importing it.

model/dflash.py is copied beside every export and loaded with trust_remote_code, so it
imports nothing of ours and keeps its own check_sampling and check_verify_tokens; these are
the project's, with the same rules and messages (tests/unit/test_sampling_settings.py holds
the two homes equal). dflash-eval and dflash-datagen call these, so a bad value is refused
before torch is imported.
"""

from __future__ import annotations


def check_verify_tokens(verify_tokens: int | None, block_size: int) -> int:
    """The drafts verified per step: ``verify_tokens``, or all B-1 of a block when None.
    ValueError naming a value outside 1..B-1. (A drafter whose block of B proposes B
    drafts, DSpark's, passes B + 1.)"""
    if verify_tokens is None:
        return block_size - 1
    if isinstance(verify_tokens, bool) or not isinstance(verify_tokens, int) or not 1 <= verify_tokens < block_size:
        raise ValueError(f"verify_tokens={verify_tokens!r}: must be an integer in 1..{block_size - 1} (the drafts of a "
                         f"block of {block_size}) or null for all of them")
    return verify_tokens


def check_sampling(temperature: float, top_p: float = 1.0, top_k: int = 0, prefix: str = "") -> None:
    """The check of sampling settings (dflash-eval's, data generation's): ValueError naming
    the offending value, ``prefix`` its recipe section ("sampling.")."""
    if temperature < 0:
        raise ValueError(f"{prefix}temperature={temperature}: must be >= 0 (0 is greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"{prefix}top_p={top_p}: must be in (0, 1]")
    if top_k < 0:
        raise ValueError(f"{prefix}top_k={top_k}: must be >= 0 (0 disables it)")
