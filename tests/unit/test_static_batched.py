"""Batched decoding on the static runtime (eval/static_batched.py) on CPU, float32: every row
of a ragged batch is its batch-1 static run (the same tokens, the same acceptance length at
every step) and plain greedy decoding of that row alone, at several batch sizes; rows that
stop early stop while the others go on; sampling keeps the target's distribution; eval.speed
measures it at batch_size=N."""

import pytest
import torch

from dflash_train.eval.acceptance import target_generate
from dflash_train.eval.static_batched import plain_static_batch, slot_layout, speculate_static_batch
from dflash_train.eval.speed import format_speed_table
from dflash_train.eval.speed_job import batches, measure
from dflash_train.model.dflash import Sampling
from dflash_train.model.runtime import spec_generate
from tests.unit.test_eval_cli import CharTokenizer, chat_items, chat_models, eval_cfg  # noqa: F401 (fixture)
from tests.unit.test_runtime import (
    CHI2_CRIT_7DF,
    VOCAB,
    chi_square,
    exact_marginals,
    models,  # noqa: F401  (fixture)
)
from tests.unit.test_runtime_drafter import (  # noqa: F401  (prompts, target, trained: fixtures)
    BLOCK,
    DRAFTERS,
    NEW_TOKENS,
    prompts,
    target,
    tiny_drafter,
    trained,
)

pytestmark = pytest.mark.usefixtures("one_thread")

BATCH_SIZES = (2, 3, 5)


def ragged_rows(target, prompts):  # noqa: F811
    """Five prompts of lengths 6..9: the memorised ones, some extended by the start of their
    own greedy answers (so the trained drafter still knows what follows), and one repeated."""
    rows = [target_generate(target, prompts[i:i + 1], k)[0].tolist() if k else prompts[i].tolist()
            for i, k in enumerate((0, 2, 1, 3))]
    return rows + [rows[2][:-1]]


def test_slot_layout_puts_each_prompt_at_its_own_positions():
    ids, positions, lengths = slot_layout([[7, 8, 9], [5], [1, 2]], "cpu")
    assert ids.tolist() == [[7, 8, 9], [0, 0, 5], [0, 1, 2]]
    # padding sits past the prompt (slots a later block writes before anything reads them)
    assert positions.tolist() == [[0, 1, 2], [1, 2, 0], [2, 0, 1]]
    assert lengths.tolist() == [[3], [1], [2]]


@pytest.mark.parametrize("which", list(DRAFTERS))
def test_each_row_is_its_batch_one_static_run(target, prompts, trained, which):  # noqa: F811
    drafter = trained if DRAFTERS[which] is None else tiny_drafter(target, seed=6, **DRAFTERS[which])
    rows = ragged_rows(target, prompts)
    singles = [spec_generate(drafter, target, torch.tensor([p]), NEW_TOKENS, return_stats=True, static=True)
               for p in rows]
    plain = [target_generate(target, torch.tensor([p]), NEW_TOKENS)[0, len(p):].tolist() for p in rows]
    for size in BATCH_SIZES:
        outs = speculate_static_batch(drafter, target, rows[:size], NEW_TOKENS, Sampling())
        assert drafter.__dict__["_static_runtime"].block.shape == (size, BLOCK)  # one runtime, `size` rows
        assert plain_static_batch(target, rows[:size], NEW_TOKENS) == plain[:size]
        for p, out, one, expected in zip(rows, outs, singles, plain):
            assert out.output_ids[0, len(p):].tolist() == expected
            assert torch.equal(out.output_ids, one.output_ids)
            assert out.acceptance_lengths == one.acceptance_lengths  # each row accepts its own prefix
            assert out.num_new_tokens == NEW_TOKENS == 1 + sum(out.acceptance_lengths)
    steps = [n for out in outs for n in out.acceptance_lengths]
    if which == "trained":  # rows accept different lengths at the same step, so they drift apart
        assert sum(steps) / len(steps) > 1.5 and max(steps) == BLOCK and min(steps) == 1
        assert len({len(out.acceptance_lengths) for out in outs}) > 1


def test_rows_that_stop_early_end_while_the_others_go_on(target, prompts, trained):  # noqa: F811
    rows = ragged_rows(target, prompts)[:4]
    answer = target_generate(target, torch.tensor([rows[1]]), NEW_TOKENS)[0, len(rows[1]):].tolist()
    stops = [answer[7]]  # ends row 1 after 8 tokens (and any row that emits it)
    expected = [target_generate(target, torch.tensor([p]), NEW_TOKENS, stops)[0, len(p):].tolist() for p in rows]
    outs = speculate_static_batch(trained, target, rows, NEW_TOKENS, Sampling(), stops)
    assert [out.output_ids[0, len(p):].tolist() for p, out in zip(rows, outs)] == expected
    assert plain_static_batch(target, rows, NEW_TOKENS, stops) == expected
    assert len(expected[1]) <= 8 and expected[1][-1] == stops[0]
    assert max(len(e) for e in expected) == NEW_TOKENS  # another row ran its whole budget
    for p, out in zip(rows, outs):
        one = spec_generate(trained, target, torch.tensor([p]), NEW_TOKENS, stop_token_ids=stops, return_stats=True,
                                    static=True)
        assert out.acceptance_lengths == one.acceptance_lengths


@pytest.mark.parametrize("new_tokens", [1, 2, 5])
def test_short_budgets_equal_plain_decoding(target, prompts, trained, new_tokens):  # noqa: F811
    """Budgets shorter than a block: the masks hide the slots past each row's own end."""
    rows = ragged_rows(target, prompts)[:3]
    outs = speculate_static_batch(trained, target, rows, new_tokens, Sampling())
    for p, out in zip(rows, outs):
        assert out.output_ids[0, len(p):].tolist() == target_generate(target, torch.tensor([p]), new_tokens)[
            0, len(p):].tolist()
        assert out.num_new_tokens == new_tokens


def test_batched_static_sampling_keeps_the_target_distribution(models, few_static_slots):  # noqa: F811
    tiny, drafter = models
    prompt, new, temperature, rows, rounds = [1, 5, 2, 3], 4, 0.6, 250, 12
    exact = exact_marginals(tiny, torch.tensor([prompt]), temperature)
    gen = torch.Generator().manual_seed(99)
    counts = torch.zeros(new, VOCAB)
    for _ in range(rounds):
        for out in speculate_static_batch(drafter, tiny, [prompt] * rows, new, Sampling(temperature), generator=gen):
            counts[torch.arange(new), out.output_ids[0, len(prompt):]] += 1
    chi2 = [chi_square(counts[k], exact[k]) for k in range(new)]
    assert max(chi2) < CHI2_CRIT_7DF, chi2
    # the same counts drawn at temperature 1 fail: the check has power
    wrong = exact_marginals(tiny, torch.tensor([prompt]), 1.0)
    assert min(chi_square(counts[k], wrong[k]) for k in range(new)) > CHI2_CRIT_7DF


def test_batches_cycle_the_prompts_into_whole_batches(chat_models):  # noqa: F811
    items = chat_items(CharTokenizer())
    groups = batches(items, 2)
    assert [[pid for pid, _ in g] for g in groups] == [["chat/1", "chat/2"], ["chat/3", "chat/1#1"]]
    assert groups[1][1][1] == items[0][1][0].tolist()
    assert [[pid for pid, _ in g] for g in batches(items, 1)] == [["chat/1"], ["chat/2"], ["chat/3"]]


def test_speed_measures_batches_on_both_runtimes(chat_models):  # noqa: F811
    target, drafter = chat_models
    items = chat_items(CharTokenizer())
    cfg = eval_cfg("drafter_path=random", "max_new_tokens=6", "batch_size=2", "runtime=auto")
    summaries = measure(cfg, {"chat": ("chat", items)}, target, drafter, [], None)
    assert list(summaries) == ["dynamic", "static"]
    for s in summaries.values():  # 3 prompts in two batches of 2 rows: 4 rows of 6 tokens, all lossless
        assert (s["num_prompts"], s["plain_tokens"], s["spec_tokens"], s["greedy_agreement"]) == (4, 24, 24, 1.0)
        assert s["plain_s"] > 0 and s["spec_s"] > 0
    assert [line.split()[0] for line in format_speed_table(summaries).splitlines()[2:]] == ["dynamic", "static"]
    assert drafter.__dict__["_static_runtime"].block.shape[0] == 2
