"""Batched evaluation decoding: every row is its batch-1 run (float32), per-row stops and
budgets, per-row acceptance, and rejection sampling that keeps the target's distribution."""

import pytest
import torch

from dflash_train.eval.acceptance import target_generate
from dflash_train.eval import batched
from dflash_train.eval.batched import spec_generate_batch, target_generate_batch
from dflash_train.model.dflash import SLIDING_ATTENTION, DFlashConfig, DFlashDraftModel, Sampling, StepClock
from tests.conftest import make_tiny_target
from tests.unit.test_runtime import (
    CHI2_CRIT_7DF,
    VOCAB,
    chi_square,
    exact_marginals,
    models,  # noqa: F401  (fixture)
)
from tests.unit.test_runtime_drafter import (  # noqa: F401  (prompts, target, trained: fixtures)
    BLOCK,
    NEW_TOKENS,
    full_block_steps,
    prompts,
    target,
    tiny_drafter,
    trained,
)

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTHS = (5, 9, 3, 7)  # ragged prompts: every row but one is left-padded


def _ragged(seed=3, vocab=90):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_each_row_is_its_batch_one_run(arch, monkeypatch):
    compactions = []
    compaction = batched._compaction

    def spy(valid, longest):
        idx = compaction(valid, longest)
        if idx is not None:
            compactions.append((valid.shape[1], idx.shape[1]))
        return idx

    monkeypatch.setattr(batched, "_compaction", spy)
    tiny = make_tiny_target(arch)
    torch.manual_seed(1)
    drafter = DFlashDraftModel(DFlashConfig.from_target(tiny.config, mask_token_id=96, num_hidden_layers=2,
                                                        block_size=4)).eval()
    rows = _ragged()
    plain = [target_generate(tiny, torch.tensor([p]), 20)[0, len(p):].tolist() for p in rows]
    stop = plain[1][6]  # ends row 1 early, and any other row that emits it
    for new, stops in ((20, None), (1, None), (13, [stop])):
        spec = spec_generate_batch(drafter, tiny, rows, new, Sampling(), stops)
        plain_batch = target_generate_batch(tiny, rows, new, stops)
        for p, out, got_plain in zip(rows, spec, plain_batch):
            one = drafter.spec_generate(tiny, torch.tensor([p]), new, stop_token_ids=stops, return_stats=True)
            expected = target_generate(tiny, torch.tensor([p]), new, stops)[0, len(p):].tolist()
            assert torch.equal(out.output_ids, one.output_ids)
            assert out.output_ids[0, len(p):].tolist() == got_plain == expected
            assert out.num_new_tokens == len(expected) and sum(out.acceptance_lengths) == len(expected) - 1
    assert plain_batch[1][-1] == stop and len(plain_batch[1]) < 13  # the stop really ended row 1
    # the caches were compacted along the way (to at most half their slots), and nothing changed
    assert compactions and all(2 * after <= before for before, after in compactions)


def test_plain_rows_record_their_batch_one_top2_gaps():
    """The lossless report's gaps: one per recorded token of each row, as its batch-1 run's."""
    tiny = make_tiny_target("llama")
    rows = _ragged()
    plain = [target_generate(tiny, torch.tensor([p]), 12)[0, len(p):].tolist() for p in rows]
    stops = [plain[2][4]]  # row 2 stops within 5 tokens; rows that never emit it go on to 12
    gaps = [[] for _ in rows]
    news = target_generate_batch(tiny, rows, 12, stops, gaps_ulps=gaps)
    for p, new, got in zip(rows, news, gaps):
        expected = []
        target_generate(tiny, torch.tensor([p]), 12, stops, gaps_ulps=expected)
        assert len(got) == len(new) == len(expected)
        assert got == pytest.approx(expected, rel=1e-4, abs=1e-3)
    assert len(gaps[2]) == plain[2].index(stops[0]) + 1 <= 5
    assert any(len(g) == 12 for g in gaps)  # the batch went on after row 2 stopped


@pytest.mark.parametrize("which", ["trained", "sliding"])
def test_rows_accept_what_their_batch_one_runs_accept(target, prompts, trained, which):  # noqa: F811
    drafter = trained if which == "trained" else tiny_drafter(
        target, seed=6, layers=2, layer_types=[SLIDING_ATTENTION, "full_attention"], sliding_window=5,
        use_sliding_window=True, initializer_range=0.2)
    # ragged prompts: the memorised ones extended by the start of their own answers, so the
    # rows are left-padded and the drafter still knows what follows
    rows = [target_generate(target, prompts[i:i + 1], k)[0].tolist() if k else prompts[i].tolist()
            for i, k in enumerate((0, 2, 1, 3))]
    clock = StepClock(target.device)
    outs = spec_generate_batch(drafter, target, rows, NEW_TOKENS, Sampling(), clock=clock)
    steps = []
    for p, out in zip(rows, outs):
        one = drafter.spec_generate(target, torch.tensor([p]), NEW_TOKENS, return_stats=True)
        assert torch.equal(out.output_ids, one.output_ids)
        # the same drafts while a whole block remains (batch 1 narrows its last blocks)
        n = full_block_steps(one.acceptance_lengths, NEW_TOKENS, BLOCK)
        assert out.acceptance_lengths[:n] == one.acceptance_lengths[:n] and n >= len(one.acceptance_lengths) - 3
        steps += out.acceptance_lengths
    if which == "trained":
        assert sum(steps) / len(steps) > 1.5
    assert set(outs[0].step_times) == {"draft", "verify", "bookkeeping"}


def test_batched_rejection_sampling_keeps_the_target_distribution(models):  # noqa: F811
    tiny, drafter = models
    prompt, new, temperature, draws = [1, 5, 2, 3], 4, 0.6, 3000
    exact = exact_marginals(tiny, torch.tensor([prompt]), temperature)
    gen = torch.Generator().manual_seed(99)
    counts = torch.zeros(new, VOCAB)
    for _ in range(draws // 1000):
        for out in spec_generate_batch(drafter, tiny, [prompt] * 1000, new, Sampling(temperature), generator=gen):
            counts[torch.arange(new), out.output_ids[0, len(prompt):]] += 1
    chi2 = [chi_square(counts[k], exact[k]) for k in range(new)]
    assert max(chi2) < CHI2_CRIT_7DF, chi2
