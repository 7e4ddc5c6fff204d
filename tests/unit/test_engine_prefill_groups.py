"""How the generation engine groups the rows of a prefill after kept prefixes
(data_gen/engine.py `_kept_groups`): every row exactly once, longest rows first, and each
forward within its three budgets (cache columns gathered, tokens fed, masked pairs), so a
group never pads short rows out to a long row's span by the hundreds (the 2026-11-28 profile:
50 s of prefill for 389 admissions, where rows grouped by new tokens alone read 3,000-column
spans each and SDPA's math kernel materialised their scores)."""

import random

import pytest

from data_gen import engine
from data_gen.engine import KEPT_COLUMNS, KEPT_SCORES, PREFILL_TOKENS, _kept_groups


def rows(count: int, seed: int) -> list[tuple[int, list[int], int]]:
    """(slot, tokens, start) of later turns: histories of 50-3,000 tokens, 5-400 new ones."""
    rng = random.Random(seed)
    out = []
    for slot in range(count):
        start = rng.randint(50, 3000)
        out.append((slot, [7] * (start + rng.randint(5, 400)), start))
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_every_row_once_longest_first_within_the_budgets(seed):
    todo = rows(2000, seed)
    groups = list(_kept_groups(todo, columns=4096))
    seen = [slot for _, _, group in groups for slot, _, _ in group]
    assert sorted(seen) == list(range(2000))
    lengths = [len(tokens) for _, _, group in groups for _, tokens, _ in group]
    assert lengths == sorted(lengths, reverse=True)
    for width, span, group in groups:
        assert width == max(len(t) - start for _, t, start in group)
        assert span % 16 == 0 and max(len(t) for _, t, _ in group) <= span < max(len(t) for _, t, _ in group) + 16
        if len(group) > 1:
            assert len(group) * span <= KEPT_COLUMNS and len(group) * width <= PREFILL_TOKENS
            assert len(group) * width * span <= KEPT_SCORES
    # the budgets bind: no group could have taken the next group's first row
    for (width, span, group), (_, _, following) in zip(groups, groups[1:]):
        _, tokens, start = following[0]
        wider = max(width, len(tokens) - start)
        n = len(group) + 1
        assert n * span > KEPT_COLUMNS or n * wider > PREFILL_TOKENS or n * wider * span > KEPT_SCORES


def test_a_row_over_every_budget_goes_alone_and_the_span_stays_in_the_cache(monkeypatch):
    monkeypatch.setattr(engine, "KEPT_COLUMNS", 100)
    (width, span, group), *rest = _kept_groups([(3, [1] * 1000, 10), (4, [1] * 20, 19)], columns=1001)
    assert (width, span, [r[0] for r in group]) == (990, 1001, [3])  # 1,008 rounded, cut to the cache's 1,001
    assert [(w, s, [r[0] for r in g]) for w, s, g in rest] == [(1, 32, [4])]


def test_rows_with_nothing_new_are_left_out():
    assert list(_kept_groups([(0, [1, 2, 3], 3)], columns=64)) == []
