"""How the generation engine groups the rows of a prefill after kept prefixes
(data_gen/engine_prefill.py `kept_groups`): every row exactly once, longest rows first, and each
forward within its three budgets (cache columns gathered, tokens fed, masked pairs), eager or
at the bucketed shapes of CUDA graphs (powers of two, the fresh rows' groups too), so a
group never pads short rows out to a long row's span by the hundreds (the 2026-11-28 profile:
50 s of prefill for 389 admissions, where rows grouped by new tokens alone read 3,000-column
spans each and SDPA's math kernel materialised their scores)."""

import random

import pytest

from data_gen import engine_prefill
from data_gen.engine_prefill import (BUCKET_SPAN, BUCKET_WIDTH, KEPT_COLUMNS, KEPT_SCORES, PREFILL_TOKENS, Shapes,
                                     kept_groups, prefill_groups)

EAGER = Shapes(False, 4096)


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
    groups = [(width, span, group) for rows, width, span, group in kept_groups(todo, EAGER) if rows == len(group)]
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
    monkeypatch.setattr(engine_prefill, "KEPT_COLUMNS", 100)
    (rows, width, span, group), *rest = kept_groups([(3, [1] * 1000, 10), (4, [1] * 20, 19)], Shapes(False, 1001))
    assert (rows, width, span, [r[0] for r in group]) == (1, 990, 1001, [3])  # 1,008 rounded, cut to the cache's 1,001
    assert [(n, w, s, [r[0] for r in g]) for n, w, s, g in rest] == [(1, 1, 32, [4])]


def test_rows_with_nothing_new_are_left_out():
    assert list(kept_groups([(0, [1, 2, 3], 3)], EAGER)) == []


def pow2(n: int) -> bool:
    return n & (n - 1) == 0


def up(n: int) -> int:
    """The least power of two >= n, by doubling."""
    p = 1
    while p < n:
        p *= 2
    return p


@pytest.mark.parametrize("seed", [0, 1])
def test_bucketed_kept_groups_are_powers_of_two_within_the_budgets(seed):
    """With CUDA graphs a forward's rows, width and span are powers of two (a width from
    BUCKET_WIDTH, a span from BUCKET_SPAN), at least the group's, and the budgets hold for the
    padded shape; so few shapes come that each is captured once."""
    todo = rows(2000, seed)
    groups = list(kept_groups(todo, Shapes(True, 4096)))
    assert sorted(slot for *_, group in groups for slot, _, _ in group) == list(range(2000))
    for n, width, span, group in groups:
        assert pow2(n) and n >= len(group) > n // 2
        new = max(len(t) - start for _, t, start in group)
        assert width == max(BUCKET_WIDTH, up(new))
        longest = max(len(t) for _, t, _ in group)
        assert span == max(BUCKET_SPAN, up(longest))
        if len(group) > 1:
            assert n * span <= KEPT_COLUMNS and n * width <= PREFILL_TOKENS and n * width * span <= KEPT_SCORES
    shapes = {(n, w, s) for n, w, s, _ in groups}
    assert len(shapes) < len(groups) / 2, "shapes repeat: their graphs are replayed"


def test_bucketed_shapes_stay_in_the_cache():
    """A cache of 1,000 columns (not a power of two): widths and spans are cut to it."""
    shapes = Shapes(True, 1000)
    [(n, width, span, group)] = kept_groups([(0, [1] * 990, 10), (1, [1] * 600, 590)], shapes)
    assert (n, width, span, [r[0] for r in group]) == (2, 1000, 1000, [0, 1])
    [(n, width, group)] = prefill_groups([(0, [1] * 900), (1, [1] * 20), (2, [1] * 7)], shapes)
    assert (n, width, [r[0] for r in group]) == (4, 1000, [2, 1, 0])


@pytest.mark.parametrize("buckets", [False, True])
def test_fresh_groups_every_row_once_within_the_tokens(buckets):
    rng = random.Random(2)
    todo = [(slot, [7] * rng.randint(1, 4000)) for slot in range(3000)]
    groups = list(prefill_groups(todo, Shapes(buckets, 4096)))
    assert sorted(slot for *_, group in groups for slot, _ in group) == list(range(3000))
    for n, width, group in groups:
        longest = max(len(t) for _, t in group)
        assert n >= len(group) and width >= longest
        assert n * width <= PREFILL_TOKENS or len(group) == 1
        if buckets:
            assert pow2(n) and n < 2 * len(group) and width == min(4096, max(BUCKET_WIDTH, up(longest)))
        else:
            assert (n, width) == (len(group), longest)
