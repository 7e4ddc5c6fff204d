"""Seeded sampling of answer tokens: one uniform number per (prompt, position), drawn from
the prompt's own seed, turned into a token by inverse-CDF sampling.

Each prompt carries its seed (the pipeline derives it from the run seed, the prompt id and
the turn), and the k-th token of its answer uses the k-th number of that seed's stream. The
draws therefore depend on nothing but the prompt's seed: not on the batch it lands in, its
row, the other prompts or the number of ranks. Given the same logits, the same tokens come
out (exactly in float32 on CPU, where our batched and unbatched logits agree; on a GPU the
logits of a row can change in the last bits with the batch shape, and a draw that falls
within that difference of a CDF step picks the neighbouring token).

Inverse-CDF needs a single number per token, so a device sampler can precompute the whole
stream of a prompt in one call. With top_k or top_p the distribution is cut in descending
order of probability, so the CDF runs over the sorted vocabulary; without them it runs over
the vocabulary in token order: the same distribution, and no sort of (slots x vocabulary)
numbers in every decode step (at 512 slots and Qwen's 151,936 tokens, 78M float64 keys a step,
which halved the engine's tokens/s at temperature 0.7 on one H100 against greedy; 2026-11-27).
"""

from __future__ import annotations

import torch

# Recorded in run.json of sampled runs: a restart must sample the way the run began.
SAMPLER = "per_prompt_inverse_cdf_v2"  # v1 ran the CDF over the sorted vocabulary always


def uniform_stream(seeds: list[int], length: int) -> torch.Tensor:
    """(len(seeds), length) float64 numbers in [0, 1): row i is seed i's stream."""
    rows = []
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed & ((1 << 63) - 1))
        rows.append(torch.rand(length, generator=gen, dtype=torch.float64))
    return torch.stack(rows) if rows else torch.empty(0, length, dtype=torch.float64)


def sample_tokens(logits: torch.Tensor, u: torch.Tensor, temperature: float, top_p: float = 1.0,
                  top_k: int = 0) -> torch.Tensor:
    """One token per row of ``logits`` (B, V) for the numbers ``u`` (B,) in [0, 1).

    The distribution is softmax(logits / temperature), cut to the ``top_k`` most likely
    tokens (0: all), then to the smallest set of most likely tokens whose mass reaches
    ``top_p`` of what remains, renormalised (the order transformers applies them in).
    """
    probs = torch.softmax(logits.double() / temperature, dim=-1)  # (B, V)
    if top_k <= 0 and top_p >= 1:  # nothing cut: the CDF in token order
        return _inverse_cdf(probs, u)
    # Stable: equal probabilities keep their token order, so ties never depend on the kernel.
    probs, order = probs.sort(dim=-1, descending=True, stable=True)
    if 0 < top_k < probs.shape[-1]:
        probs[:, top_k:] = 0
    if top_p < 1:
        before = probs.cumsum(-1) - probs  # mass of the more likely tokens
        probs = torch.where(before < top_p * probs.sum(-1, keepdim=True), probs, torch.zeros_like(probs))
    return order.gather(-1, _inverse_cdf(probs, u)[:, None]).squeeze(-1)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The index (B,) of each row of ``probs`` (B, V) where its running mass passes ``u`` of
    its total. A zero-probability index after the last kept one is never picked: u < 1 keeps
    the point below the total, so the first index whose cdf exceeds it carries mass."""
    cdf = probs.cumsum(-1)  # (B, V)
    target = u.to(cdf).unsqueeze(-1) * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[-1] - 1).squeeze(-1)
