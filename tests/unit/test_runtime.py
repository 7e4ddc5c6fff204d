"""The runtime on tiny targets: rejection sampling keeps the target's distribution exactly."""

import itertools

import pytest
import torch

from dflash_train.model.dflash import ContextCache, DFlashConfig, DFlashDraftModel, Sampling
from dflash_train.model.runtime import spec_generate
from tests.conftest import make_tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 8
NEW = 4
DRAWS = 1000  # each draw is a whole speculative decode (about 15 ms): the test's cost
# chi-square critical value for 7 degrees of freedom at p = 1e-4: a correct sampler fails
# one position's check about once in 10,000 runs; the seed is fixed, so the test is stable.
CHI2_CRIT_7DF = 29.88


@pytest.fixture(scope="module")
def models():
    # a large init makes the tiny models' distributions peaked and different from each other
    target = make_tiny_target("llama", vocab=VOCAB, layers=3, initializer_range=0.4, seed=11)
    cfg = DFlashConfig.from_target(target.config, mask_token_id=VOCAB - 1, num_hidden_layers=1, block_size=4,
                                   initializer_range=0.4)
    torch.manual_seed(12)
    return target, DFlashDraftModel(cfg).eval()


def exact_marginals(target, prompt, temperature):
    """P(token at each new position) by enumerating all VOCAB**NEW continuations."""
    seqs = torch.tensor(list(itertools.product(range(VOCAB), repeat=NEW)))  # (V^4, 4)
    full = torch.cat([prompt.expand(len(seqs), -1), seqs], dim=1)
    with torch.no_grad():
        logp = torch.log_softmax(target(full).logits.float() / temperature, -1)  # (V^4, T, V)
    p0 = prompt.shape[1]
    steps = logp[:, p0 - 1 : p0 - 1 + NEW].gather(-1, seqs[..., None])[..., 0]  # (V^4, 4)
    prob = steps.sum(-1).exp()
    return torch.stack([torch.zeros(VOCAB).index_add_(0, seqs[:, k], prob) for k in range(NEW)])  # (4, V)


def chi_square(counts, probs):
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected.clamp_min(1e-9)).sum())


# Not 1: a sampler that ignores the temperature would pass there. Both sides of 1: peaked
# (more drafts accepted) and flat (more rejections and residual samples). A sampler that
# draws at temperature 1 instead gets, with these DRAWS and seed, a chi-square of 710..1610
# per position at 0.6 and 120..250 at 1.5 (measured on both runtimes), at least 4x the
# critical 29.88; it grows with DRAWS. Both runtimes: the static one accepts on the
# device, drawing every uniform of a step at once.
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("temperature", [0.6, 1.5])
def test_rejection_sampling_matches_target_distribution(models, temperature, static):
    target, drafter = models
    prompt = torch.tensor([[1, 5, 2, 3]])
    exact = exact_marginals(target, prompt, temperature)
    gen = torch.Generator().manual_seed(1234)
    counts = torch.zeros(NEW, VOCAB)
    steps = []
    for _ in range(DRAWS):
        out = spec_generate(drafter, target, prompt, NEW, temperature=temperature, return_stats=True, generator=gen,
                                    static=static)
        new = out.output_ids[0, prompt.shape[1]:]
        counts[torch.arange(NEW), new] += 1
        steps.append(out.acceptance_lengths)
    chi2 = [chi_square(counts[k], exact[k]) for k in range(NEW)]
    assert max(chi2) < CHI2_CRIT_7DF, chi2
    # The drafts were really checked: some were rejected (a step committed fewer tokens than
    # its width) and some accepted, so positions 2..4 exercised both branches.
    assert any(len(s) > 1 for s in steps) and any(s[0] > 1 for s in steps)


def test_the_check_has_power_against_the_drafts_own_distribution(models):
    """The drafter's proposals alone are far from the target: the chi-square above can fail."""
    target, drafter = models
    prompt = torch.tensor([[1, 5, 2, 3]])
    exact = exact_marginals(target, prompt, 1.0)
    first = torch.tensor([[int(exact[0].argmax())]])
    block = torch.tensor([[first.item(), VOCAB - 1]])
    logits = drafter.draft(target, block, _features(target, prompt, drafter), prompt.shape[1], ContextCache())
    q = torch.softmax(logits[0, 0], -1)
    p = _conditional(target, torch.cat([prompt, first], 1))
    assert chi_square(q * DRAWS, p) > 10 * CHI2_CRIT_7DF


@torch.no_grad()
def _features(target, prompt, drafter):
    hs = target(prompt, output_hidden_states=True).hidden_states
    return torch.cat([hs[i + 1] for i in drafter.target_layer_ids], -1)


def _conditional(target, ids):
    with torch.no_grad():
        return torch.softmax(target(ids).logits[0, -1].float(), -1)


def test_sampling_filters():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    top_k = Sampling(1.0, 1.0, 2).probs(logits)[0]
    assert top_k[2:].eq(0).all() and torch.isclose(top_k.sum(), torch.tensor(1.0))
    full = torch.softmax(logits[0], -1)
    top_p = Sampling(1.0, 0.7, 0).probs(logits)[0]  # 0.61 < 0.7 needs the second token too
    torch.testing.assert_close(top_p[:2], full[:2] / full[:2].sum())
    assert top_p[2:].eq(0).all()
    with pytest.raises(ValueError, match="top_p=1.5"):
        Sampling(1.0, 1.5, 0)


def test_greedy_lossless_and_budget_on_tiny_targets():
    for arch in ("llama", "qwen2", "qwen3"):
        target = make_tiny_target(arch)
        cfg = DFlashConfig.from_target(target.config, mask_token_id=96, num_hidden_layers=2, block_size=5)
        drafter = DFlashDraftModel(cfg).eval()
        ids = torch.randint(0, 90, (1, 7), generator=torch.Generator().manual_seed(2))
        for new in (1, 2, 9, 23):
            out = drafter.spec_generate(target, ids, new, return_stats=True)
            assert torch.equal(out.output_ids, target.generate(ids, max_new_tokens=new, do_sample=False))
            assert out.num_new_tokens == new and sum(out.acceptance_lengths) == new - 1


def test_step_times_split_the_decode_without_changing_it(models):
    target, drafter = models
    prompt = torch.tensor([[1, 5, 2, 3]])
    plain = drafter.spec_generate(target, prompt, 12, return_stats=True)
    timed = drafter.spec_generate(target, prompt, 12, return_stats=True, time_steps=True)
    assert plain.step_times is None
    assert torch.equal(timed.output_ids, plain.output_ids)
    assert set(timed.step_times) == {"draft", "verify", "bookkeeping"}
    assert all(t > 0 for t in timed.step_times.values())
    assert sum(timed.step_times.values()) <= timed.decode_s
