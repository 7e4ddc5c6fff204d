"""Acceptance metrics, the plain-decoding baseline, and one speculative-vs-plain comparison.

Acceptance length of one verify step = accepted drafts + 1 (the target's own token is
always committed), so it lies in 1..B for block size B; tau is its mean. The last step of
a generation can be cut short by max_new_tokens or a stop token; it counts with what it
committed, as the runtimes count it.

Greedy speculative output equals plain greedy output exactly in float32. In bf16 a verify
forward over a block and a one-token decode step round differently, so where the target's
top two logits are (nearly) tied the two runs can pick different tokens and drift apart
(measured on an H100 with SmolLM2: about 25% of prompts match over 128 tokens, every
divergence at a top-2 gap of at most 2 bf16 steps). Each divergence is therefore reported
with the plain run's top-2 gap there, in units of the logits' rounding step (ulps): a
divergence at a gap of a few ulps is rounding, one at a clear gap is a bug.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from dflash_train.model.dflash import device_clock
from dflash_train.model.runtime import TargetSlots, spec_generate, static_runtime

NEAR_TIE_ULPS = 4.0  # a divergence at a top-2 gap of at most this many rounding steps is numerics


@dataclass
class PromptResult:
    """Speculative and plain decoding of one prompt (one turn of it): new tokens only,
    wall-clock seconds."""

    id: str
    prompt_tokens: int
    acceptance_lengths: list[int]
    spec_ids: list[int]
    plain_ids: list[int]
    spec_s: float
    plain_s: float
    plain_gaps_ulps: list[float] = field(default_factory=list)  # top-2 gap of each plain step
    turn: int = 1  # 2 and up: a follow-up question after the target's own earlier answers
    step_times: dict | None = None  # the speculative run's seconds in draft, verify, bookkeeping

    @property
    def divergence_gap_ulps(self) -> float | None:
        """The plain run's top-2 gap where the outputs first differ; None when no token
        differs (identical outputs, or one is a prefix of the other: a length difference)."""
        d = common_prefix(self.spec_ids, self.plain_ids)
        if d >= min(len(self.spec_ids), len(self.plain_ids), len(self.plain_gaps_ulps)):
            return None
        return self.plain_gaps_ulps[d]

    def to_dict(self) -> dict:
        prefix = common_prefix(self.spec_ids, self.plain_ids)
        exact = self.spec_ids == self.plain_ids
        return {
            "id": self.id,
            "turn": self.turn,
            "prompt_tokens": self.prompt_tokens,
            "tau": mean_acceptance(self.acceptance_lengths),
            "acceptance_lengths": self.acceptance_lengths,
            "spec_tokens": len(self.spec_ids),
            "plain_tokens": len(self.plain_ids),
            "exact_match": exact,
            "first_divergence": None if exact else prefix,
            "divergence_gap_ulps": self.divergence_gap_ulps,
            "spec_s": self.spec_s,
            "plain_s": self.plain_s,
            "step_times": self.step_times,
        }


def mean_acceptance(lengths: list[int]) -> float:
    """tau. A generation that stopped at its first token has no verify step: tau is 0 then."""
    return sum(lengths) / len(lengths) if lengths else 0.0


def _check_lengths(lengths: list[int], block_size: int) -> None:
    bad = [n for n in lengths if not 1 <= n <= block_size]
    if bad:
        raise ValueError(f"acceptance lengths {bad[:5]} outside 1..{block_size} (block_size={block_size})")


def length_histogram(lengths: list[int], block_size: int) -> list[int]:
    """Counts of steps with length 1, 2, ..., block_size (index 0 is length 1)."""
    _check_lengths(lengths, block_size)
    counts = [0] * block_size
    for n in lengths:
        counts[n - 1] += 1
    return counts


def position_acceptance(lengths: list[int], block_size: int) -> list[float]:
    """For draft position k = 1..B-1: the fraction of steps that accepted at least k drafts.

    Drafts are accepted as a prefix, so this is the rate at which slot k is reached and
    right; it falls with k, and its sum plus one is tau.
    """
    _check_lengths(lengths, block_size)
    if not lengths:
        return [0.0] * (block_size - 1)
    return [sum(n - 1 >= k for n in lengths) / len(lengths) for k in range(1, block_size)]


def common_prefix(a: list[int], b: list[int]) -> int:
    """Number of leading tokens two outputs share (index of the first divergence)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def step_time_summary(results: list[PromptResult]) -> dict | None:
    """Seconds per part of the decode steps summed over ``results``, and milliseconds per
    decode step; None unless every result was timed. A batched result carries its share of
    the batch's steps (``steps``), so a batch step counts once however many rows it served."""
    if not results or any(r.step_times is None for r in results):
        return None
    parts = [k for k in results[0].step_times if k != "steps"]
    totals = {part: sum(r.step_times[part] for r in results) for part in parts}
    steps = sum(r.step_times.get("steps", len(r.acceptance_lengths)) for r in results)
    return {"seconds": totals, "ms_per_step": {k: 1000 * v / max(steps, 1) for k, v in totals.items()}}


def summarize(results: list[PromptResult], block_size: int, greedy: bool) -> dict:
    """Dataset-level metrics. tau is over all verify steps of all prompts and turns.

    Agreement is only meaningful for greedy decoding (sampled outputs differ by design),
    so it is None otherwise; it counts decodes (a two-turn prompt counts twice). Token
    agreement counts the shared prefix against the longer of the two outputs, so a
    speculative output that stops early is not 100%.
    """
    steps = [n for r in results for n in r.acceptance_lengths]
    spec_tokens = sum(len(r.spec_ids) for r in results)
    plain_tokens = sum(len(r.plain_ids) for r in results)
    spec_s = sum(r.spec_s for r in results)
    plain_s = sum(r.plain_s for r in results)
    spec_tps = spec_tokens / spec_s if spec_s > 0 else 0.0
    plain_tps = plain_tokens / plain_s if plain_s > 0 else 0.0
    longest = sum(max(len(r.spec_ids), len(r.plain_ids)) for r in results)
    agree = sum(r.spec_ids == r.plain_ids for r in results) / len(results) if results else 0.0
    gaps = [r.divergence_gap_ulps for r in results if r.spec_ids != r.plain_ids]
    near_ties = sum(g is not None and g <= NEAR_TIE_ULPS for g in gaps)
    token_agree = sum(common_prefix(r.spec_ids, r.plain_ids) for r in results) / longest if longest else 1.0
    turns = sorted({r.turn for r in results})
    return {
        "num_prompts": len({r.id for r in results}),
        "num_turns": len(results),
        "num_steps": len(steps),
        "tau": mean_acceptance(steps),
        "tau_by_turn": {str(t): mean_acceptance([n for r in results if r.turn == t for n in r.acceptance_lengths])
                        for t in turns},
        "length_histogram": length_histogram(steps, block_size),
        "position_acceptance": position_acceptance(steps, block_size),
        "greedy_agreement": agree if greedy else None,
        "token_agreement": token_agree if greedy else None,
        "divergent_prompts": len(gaps) if greedy else None,
        "near_tie_divergences": near_ties if greedy else None,  # of divergent_prompts
        "spec_tokens": spec_tokens,
        "plain_tokens": plain_tokens,
        "spec_s": spec_s,
        "plain_s": plain_s,
        "spec_tok_s": spec_tps,
        "plain_tok_s": plain_tps,
        "speedup": spec_tps / plain_tps if plain_tps > 0 else 0.0,
        "step_times": step_time_summary(results),
    }


def next_token(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """(1, V) logits -> (1, 1) token: argmax when greedy, else a sample at ``temperature``."""
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    return torch.multinomial(torch.softmax(logits.float() / temperature, dim=-1), 1)


def top2_gap_ulps(logits: torch.Tensor, dtype: torch.dtype | None = None) -> float:
    """(1, V) logits -> gap between the two largest, in rounding steps of the largest: the
    spacing of representable values of ``dtype`` (the model's compute dtype; default the
    logits' own) at that magnitude. A model that upcasts its logits still rounded in bf16."""
    return top2_gaps_ulps([logits[0].topk(2).values], dtype)[0]


def top2_gaps_ulps(top2: list[torch.Tensor], dtype: torch.dtype | None = None) -> list[float]:
    """`top2_gap_ulps` of each step's two largest logits (a (2,) tensor per step), read from
    the device in one copy: decoding records them without waiting for the device."""
    if not top2:
        return []
    eps = torch.finfo(dtype or top2[0].dtype).eps
    top = torch.stack(top2).float()  # (steps, 2)
    gaps = []
    for first, gap in zip(top[:, 0].tolist(), (top[:, 0] - top[:, 1]).tolist()):
        exponent = math.frexp(abs(first) or 1.0)[1] - 1  # floor(log2 |top|)
        gaps.append(gap / math.ldexp(eps, exponent))
    return gaps


@torch.inference_mode()
def target_generate(model, input_ids: torch.Tensor, max_new_tokens: int, stop_token_ids=None,
                    temperature: float = 0.0, gaps_ulps: list[float] | None = None,
                    static: bool = False) -> torch.Tensor:
    """Plain autoregressive decoding with a KV cache: the baseline speculative output must equal.

    Returns (1, T + n) ids, prompt included; stops after emitting a stop token.
    ``gaps_ulps``, when given, receives the top-2 gap (``top2_gap_ulps``) of every step.
    ``static``: the static runtime's slot cache and one-token step (a CUDA graph on a GPU).
    """
    top2 = None if gaps_ulps is None else []
    out = plain_decode(model, input_ids, max_new_tokens, stop_token_ids, temperature, top2, static)
    if gaps_ulps is not None:
        gaps_ulps += top2_gaps_ulps(top2, model.dtype)
    return out


@torch.inference_mode()
def plain_decode(model, input_ids: torch.Tensor, max_new_tokens: int, stop_token_ids, temperature: float,
                 top2: list | None, static: bool) -> torch.Tensor:
    """`target_generate`'s loop: ``top2`` receives each step's two largest logits, left on the
    device (converting them is the caller's, outside any timing)."""
    stop = set(stop_token_ids or ())
    if static:
        runtime = static_runtime(model, input_ids.shape[1] + max_new_tokens,
                                 lambda rt, size: rt.fits(model, size, True),
                                 lambda size: TargetSlots(model, size, width=1))
        logits = runtime.prefill(input_ids, logits_to_keep=1)[0]
    else:
        cache = DynamicCache(config=model.config)
        logits = model(input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    new = []
    for _ in range(max_new_tokens):
        token = next_token(logits[:, -1], temperature)  # (1, 1)
        if top2 is not None:
            top2.append(logits[0, -1].topk(2).values)
        new.append(token)
        # the one device->host copy of a step, and only when a stop token can end the run
        if len(new) == max_new_tokens or (stop and token.item() in stop):
            break
        if static:
            runtime.ids.copy_(token)
            runtime.positions.fill_(input_ids.shape[1] + len(new) - 1)
            logits = runtime.step()[0]
        else:
            logits = model(token, past_key_values=cache, use_cache=True).logits
    return torch.cat([input_ids, *new], dim=1)


def trim_output(new_ids: list[int], max_new_tokens: int, stop_token_ids) -> list[int]:
    """Cut at ``max_new_tokens`` and just after the first stop token: what a user receives.

    Applied to both outputs so a runtime that commits a whole block past the end is
    compared on the same span.
    """
    new_ids = new_ids[:max_new_tokens]
    stop = set(stop_token_ids or ())
    for i, t in enumerate(new_ids):
        if t in stop:
            return new_ids[: i + 1]
    return new_ids


def timed(fn, device: torch.device):
    """Run ``fn`` and return (result, seconds), waiting for queued GPU work on both ends."""
    start = device_clock(device)
    result = fn()
    return result, device_clock(device) - start


def compare_prompt(drafter, model, prompt_id: str, input_ids: torch.Tensor, max_new_tokens: int,
                   stop_token_ids: list[int], temperature: float = 0.0, seed: int = 0, turn: int = 1,
                   time_steps: bool = False, static: bool = False, verify_tokens: int | None = None) -> PromptResult:
    """Decode one prompt speculatively and plainly, each timed end to end (prefill included).

    Both runs start from the same RNG seed so sampled runs are reproducible. ``time_steps``
    also splits the speculative decode steps into draft, verify and bookkeeping time (on a
    GPU that synchronises at each boundary, which slows the speculative run a little).
    ``static``: both runs use the static runtime (slot caches, CUDA graphs on a GPU). The
    plain run's top-2 gaps are read from the device after its timer stops. ``verify_tokens``:
    drafts the target verifies per step (None: the whole block).
    """
    device = input_ids.device
    prompt_len = input_ids.shape[1]
    torch.manual_seed(seed)
    stats, spec_s = timed(lambda: spec_generate(
        drafter, target=model, input_ids=input_ids, max_new_tokens=max_new_tokens, temperature=temperature,
        stop_token_ids=stop_token_ids, return_stats=True, time_steps=time_steps, static=static,
        verify_tokens=verify_tokens), device)
    torch.manual_seed(seed)
    top2: list[torch.Tensor] = []
    plain, plain_s = timed(lambda: plain_decode(model, input_ids, max_new_tokens, stop_token_ids, temperature,
                                                 top2, static), device)
    gaps = top2_gaps_ulps(top2, model.dtype)
    spec_ids = stats.output_ids[0, prompt_len:].tolist()
    plain_ids = plain[0, prompt_len:].tolist()
    return PromptResult(
        id=prompt_id,
        prompt_tokens=prompt_len,
        acceptance_lengths=[int(n) for n in stats.acceptance_lengths],
        spec_ids=trim_output(spec_ids, max_new_tokens, stop_token_ids),
        plain_ids=trim_output(plain_ids, max_new_tokens, stop_token_ids),
        spec_s=spec_s,
        plain_s=plain_s,
        plain_gaps_ulps=gaps,
        turn=turn,
        step_times=stats.step_times,
    )
