"""data_gen/sampling.py: inverse-CDF sampling from per-prompt streams, against a plain
per-row reference and against the distribution it claims."""

import math

import pytest
import torch

from data_gen.sampling import sample_tokens, uniform_stream


def reference_token(logits: list[float], u: float, temperature: float, top_p: float, top_k: int) -> int:
    """One row, one token, in plain Python: the distribution written out step by step."""
    weights = [math.exp((x - max(logits)) / temperature) for x in logits]
    order = range(len(logits))  # nothing cut: the CDF in token order
    if top_k or top_p < 1:  # cut from the most likely down: the CDF in that order
        order = sorted(order, key=lambda i: (-weights[i], i))
    kept = order[:top_k] if top_k else order
    total = sum(weights[i] for i in kept)
    nucleus, mass = [], 0.0
    for i in kept:
        if mass >= top_p * total:
            break
        nucleus.append(i)
        mass += weights[i]
    point, running = u * mass, 0.0
    for i in nucleus:
        running += weights[i]
        if point < running:
            return i
    return nucleus[-1]


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 0.5, 5), (0.6, 1.0, 3)])
def test_tokens_equal_plain_reference(temperature, top_p, top_k):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 17, generator=gen) * 2
    logits[3, 4] = logits[3, 9]  # a tie: the lower token id comes first
    u = torch.rand(64, generator=gen, dtype=torch.float64)
    got = sample_tokens(logits, u, temperature, top_p, top_k).tolist()
    want = [reference_token(logits[i].double().tolist(), float(u[i]), temperature, top_p, top_k) for i in range(64)]
    assert got == want


def test_frequencies_follow_the_cut_distribution():
    """20000 draws of one row: top_k=3 keeps tokens 0..2, top_p=0.8 of their mass keeps 0 and 1,
    renormalised to 0.6 / 0.4 (probabilities 0.45, 0.3, 0.15, 0.1 before the cuts)."""
    probs = torch.tensor([0.45, 0.3, 0.15, 0.1])
    n = 20000
    u = uniform_stream([11], n)[0]
    tokens = sample_tokens(probs.log().expand(n, 4), u, temperature=1.0, top_p=0.8, top_k=3)
    counts = torch.bincount(tokens, minlength=4).tolist()
    assert counts[2:] == [0, 0]
    # 4 standard deviations of a binomial(20000, 0.6): 277
    assert abs(counts[0] - 0.6 * n) < 280


def test_frequencies_follow_the_distribution_when_nothing_is_cut():
    """No top_k or top_p: the CDF runs in token order, and the draws follow the softmax
    (0.1, 0.45, 0.15, 0.3; 4 standard deviations of 20000 draws are under 300)."""
    probs = torch.tensor([0.1, 0.45, 0.15, 0.3])
    n = 20000
    u = uniform_stream([12], n)[0]
    counts = torch.bincount(sample_tokens(probs.log().expand(n, 4), u, temperature=1.0), minlength=4)
    assert (counts.double() - probs.double() * n).abs().max() < 300
    # the token-order CDF: u below 0.1 picks token 0, between 0.1 and 0.55 token 1
    assert sample_tokens(probs.log().expand(2, 4), torch.tensor([0.05, 0.5], dtype=torch.float64), 1.0).tolist() == [0, 1]


def test_streams_depend_on_their_seed_only():
    """A prompt's numbers are the same whatever else is drawn beside it, and differ by seed."""
    alone = uniform_stream([5], 8)
    among = uniform_stream([9, 5, 2**63 - 1], 8)
    assert torch.equal(alone[0], among[1]) and not torch.equal(among[0], among[1])
    assert ((among >= 0) & (among < 1)).all() and among.dtype == torch.float64
    assert uniform_stream([], 8).shape == (0, 8)


def test_a_row_does_not_depend_on_its_batch():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 50, generator=gen)
    u = uniform_stream(list(range(6)), 1)[:, 0]
    together = sample_tokens(logits, u, 0.8, 0.95, 0)
    apart = torch.cat([sample_tokens(logits[i:i + 1], u[i:i + 1], 0.8, 0.95, 0) for i in range(6)])
    assert torch.equal(together, apart)
