"""The engine's packed prefill (backend.prefill=packed; data_gen/engine_prefill.py packed_groups
and pack_fresh, data_gen/engine_attention.py packed_bounds, packed_mask, packed_attention): several
fresh prompts in one row, each attending to itself alone. The bounds are where each prompt
begins, then the row's end repeated (a fixed shape for a captured forward); the dense mask
is a loop's over every (query, key) pair; the attention of a packed row equals each prompt's
causal attention run alone within 1e-5, full and sliding-window; every prompt is packed
exactly once, within the token budget, longest first; the packed rows hold each prompt's
tokens at their positions and cache columns, the padding a prompt of its own written to the
last cache column. (On a GPU in half precision the row takes flash attention's
variable-length kernel: tests/gpu/test_datagen_engine_gpu.py.)"""

import random

import pytest
import torch
import torch.nn.functional as F

from data_gen.config import BackendConfig
from data_gen.engine_attention import packed_attention, packed_bounds, packed_mask, sequence_bounds
from data_gen.engine_prefill import (FRESH_PROMPT_TOKENS, KEPT_TURN_TOKENS, PACKED_FEW, PACKED_MIN, PACKED_STEP,
                                     Shapes, pack_fresh, pack_kept, packed_groups, packed_kept_groups)
from tests.kept_layout import KEYS, assert_each_conversation_alone, kept_layout


def starts_of(lengths: list[int], total: int) -> torch.Tensor:
    """Where each token's prompt starts, for prompts of `lengths` packed then padded to `total`."""
    assert total >= sum(lengths)
    out, at = [], 0
    for n in lengths:
        out += [at] * n
        at += n
    return torch.tensor(out + [at] * (total - at))


# one-token prompts, prompts on and beside powers of two, a long one
LENGTHS = [1, 127, 2, 128, 300, 7, 45]


@pytest.mark.parametrize("total", [sum(LENGTHS), 640])
def test_bounds_are_where_each_prompt_begins_then_the_end(total):
    bounds = packed_bounds(starts_of(LENGTHS, total), sequences=12)
    begins = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))] + ([sum(LENGTHS)] if total > sum(LENGTHS) else [])
    assert bounds.dtype == torch.int32 and bounds.tolist() == begins + [total] * (13 - len(begins))


@pytest.mark.parametrize("window", [None, 1, 50, 1000])
def test_mask_is_each_prompt_causal_alone(window):
    starts = starts_of(LENGTHS, 640)
    mask = packed_mask(starts, window)
    at = starts.tolist()  # plain ints: the loop reads 409,600 pairs
    want = torch.tensor([[at[q] == at[k] and k <= q and (window is None or k > q - window)
                          for k in range(640)] for q in range(640)])
    assert torch.equal(mask, want)


@pytest.mark.parametrize("window", [None, 40])
def test_packed_attention_equals_each_prompt_alone(window):
    torch.manual_seed(0)
    starts = starts_of(LENGTHS, 640)
    q = torch.randn(1, 6, 640, 16)  # 3 query heads a KV head
    k, v = torch.randn(1, 2, 640, 16), torch.randn(1, 2, 640, 16)
    out = packed_attention(q, k, v, starts, packed_bounds(starts, 9), 640, window, 0.25, {})
    at = 0
    for n in LENGTHS + [640 - sum(LENGTHS)]:
        s = slice(at, at + n)
        t = torch.arange(n)
        causal = (t[None] <= t[:, None]) & ((t[None] > t[:, None] - window) if window else True)
        alone = F.scaled_dot_product_attention(q[:, :, s], k[:, :, s].repeat_interleave(3, 1),
                                               v[:, :, s].repeat_interleave(3, 1), attn_mask=causal, scale=0.25)
        assert torch.allclose(out[:, :, s], alone, atol=1e-5), n
        at += n


@pytest.mark.parametrize("buckets", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_groups_pack_every_prompt_once_within_the_budget(buckets, seed):
    rng = random.Random(seed)
    shapes = Shapes(buckets, 8192, packed_most=4096, slots=64)
    todo = [(slot, [slot] * rng.randint(0, 3000)) for slot in range(60)] + [(60, [1] * 5000)]  # one over the budget
    groups = list(packed_groups(todo, shapes))
    packed = [slot for _, group in groups for slot, _ in group]
    assert sorted(packed) == sorted(slot for slot, t in todo if t), "every non-empty prompt once"
    assert groups[0][1] == [(60, [1] * 5000)], "the longest first, alone over the budget"
    for length, group in groups:
        n = sum(len(t) for _, t in group)
        assert n <= 4096 or len(group) == 1
        assert len(group) <= shapes.prompts(length, FRESH_PROMPT_TOKENS)
        # flash attention's longest sequence (Shapes.longest) bounds every prompt and the padding
        assert max(len(t) for _, t in group) <= shapes.longest(length) and length - n <= shapes.longest(length)
        assert length == (n if not buckets else max(PACKED_MIN, 1 << (n - 1).bit_length()) if n <= PACKED_STEP
                          else -(-n // PACKED_STEP) * PACKED_STEP)
        assert [len(t) for _, t in group] == sorted((len(t) for _, t in group), reverse=True)
    assert len(groups) <= sum(len(t) for _, t in todo) // 4096 + 3, "first fit: few forwards"


def test_pack_lays_out_tokens_positions_slots_columns_and_starts():
    rows = pack_fresh([(3, [11, 12, 13]), (0, [21, 22])], length=8, columns=100)
    assert rows == [[11, 12, 13, 21, 22, 0, 0, 0],
                    [0, 1, 2, 0, 1, 0, 0, 0],
                    [3, 3, 3, 0, 0, 3, 3, 3],
                    [0, 1, 2, 0, 1, 99, 99, 99],
                    [0, 0, 0, 3, 3, 5, 5, 5]]


@pytest.mark.parametrize("kwargs, message", [
    ({"kind": "engine", "prefill": "ragged"},
     r"^backend.prefill='ragged': expected one of \['auto', 'padded', 'packed'\]$"),
    ({"kind": "hf", "prefill": "packed"}, r"^backend.prefill='packed' is the engine's; backend.kind is 'hf'$"),
])
def test_bad_prefill_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BackendConfig(**kwargs).check()


@pytest.mark.parametrize("prefill, want", [("auto", "padded"), ("padded", "padded"), ("packed", "packed")])
def test_auto_prefill_is_padded_where_flash_attention_is_not(smollm2, prefill, want):
    """backend.prefill=auto (the default) packs only where flash attention takes the rows (half
    precision on a GPU; tests/gpu/test_datagen_engine_gpu.py): on CPU it pads."""
    from data_gen.config import SamplingConfig
    from data_gen.engine import EngineGenerator

    assert BackendConfig().prefill == "auto"
    gen = EngineGenerator(smollm2, BackendConfig(kind="engine", batch_size=2, prefill=prefill),
                          SamplingConfig(max_new_tokens=2), [2], max_prompt_len=16)
    assert gen.engine.prefill == want


def test_kept_groups_pack_every_next_turn_once_within_the_budgets():
    """Next turns (slot, tokens, start) packed: every row once, the longest first, new tokens and
    keys (each row's tokens) within their budgets and their product within the dense budget, a
    row over them alone; the keys' bucket leaves at least the new tokens' padding for padding."""
    rng = random.Random(0)
    shapes = Shapes(True, 8192, packed_most=2048)
    todo = [(slot, [1] * n, n - rng.randint(1, 300)) for slot, n in enumerate(rng.randint(301, 3000) for _ in range(40))]
    todo.append((40, [1] * 10, 10))  # nothing new: no forward
    groups = list(packed_kept_groups(todo, shapes, 1 << 14, 1 << 22))
    assert sorted(slot for _, _, g in groups for slot, _, _ in g) == list(range(40))
    for q_len, k_len, group in groups:
        q = sum(len(t) - start for _, t, start in group)
        k = sum(len(t) for _, t, _ in group)
        assert len(group) == 1 or (q <= 2048 and k <= 1 << 14 and q * k <= 1 << 22)
        assert len(group) <= shapes.prompts(q_len, KEPT_TURN_TOKENS)
        longest = shapes.longest(q_len)
        assert max(len(t) - start for _, t, start in group) <= longest and q_len - q <= longest
        assert q_len == shapes.packed(q) and k_len == shapes.packed(k + q_len - q) and k_len - k >= q_len - q
        assert [len(t) for _, t, _ in group] == sorted((len(t) for _, t, _ in group), reverse=True)


def test_pack_kept_lays_out_new_tokens_then_keys():
    flat = pack_kept([(2, [7, 8, 9, 10], 2), (0, [5, 6, 4], 1)], q_len=6, k_len=9, columns=50)
    assert flat == ([9, 10, 6, 4, 0, 0] + [2, 3, 1, 2, 49, 49] + [2, 2, 0, 0, 2, 2] + [0, 0, 1, 1, 2, 2]
                    + [2, 2, 2, 2, 0, 0, 0, 2, 2] + [0, 1, 2, 3, 0, 1, 2, 49, 49] + [0, 0, 0, 0, 1, 1, 1, 2, 2])


@pytest.mark.parametrize("window", [None, 3])
def test_kept_attention_equals_each_conversation_alone(window):
    """Two conversations holding 5 and 2 tokens with 3 and 2 new ones, then padding: each new
    token's attention over its own conversation's keys up to its position (SDPA, one at a
    time), within 1e-5; the bounds of the numbered sequences."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 6, 7, 16), torch.randn(KEYS, 2, 16), torch.randn(KEYS, 2, 16)
    assert_each_conversation_alone(q, k, v, window, 0.25, atol=1e-5)
    q_seq, _, k_seq, _ = kept_layout()
    assert sequence_bounds(q_seq, 4).tolist() == [0, 3, 5, 7, 7]
    assert sequence_bounds(k_seq, 4).tolist() == [0, 8, 12, 15, 15]


def test_a_packed_forward_holds_one_prompt_every_so_many_tokens_and_a_slot_each_at_most():
    """A captured forward fixes flash attention's sequences and longest sequence (its grid):
    the prompts a forward of L tokens may hold are max(PACKED_FEW, L // tokens a prompt), a slot
    each at most; the longest is the row's length or, past it, the cache row (a prompt fits
    one) or PACKED_STEP (the bucketed padding is under it), whichever is more."""
    shapes = Shapes(True, 3584, slots=512)
    assert [shapes.prompts(n, FRESH_PROMPT_TOKENS) for n in (128, 512, 2048, 4096, 16384)] == [16, 16, 64, 128, 512]
    assert [shapes.prompts(n, KEPT_TURN_TOKENS) for n in (128, 2048, 8192, 16384)] == [16, 128, 512, 512]
    assert Shapes(True, 3584, slots=8).prompts(16384, FRESH_PROMPT_TOKENS) == 8 and PACKED_FEW == 16
    assert Shapes(True, 3584).prompts(1 << 20, 32) == 1 << 15, "no slots given: no bound"
    assert [shapes.longest(n) for n in (128, 2048, 3584, 4096, 16384)] == [128, 2048, 3584, 3584, 3584]
    assert Shapes(True, 100).longest(16384) == PACKED_STEP, "a short cache row: the padding's bound"


@pytest.mark.parametrize("buckets", [False, True])
def test_short_prompts_are_split_into_forwards_their_grid_allows(buckets):
    """200 prompts of 20 tokens fit one forward's token budget, but a forward of about 4,000
    tokens may hold 125 (one every 32 tokens): they are split, every prompt once, each forward
    within its length's bound; so are next turns of 8 new tokens (one every 16)."""
    shapes = Shapes(buckets, 3584, slots=512)
    groups = list(packed_groups([(slot, [1] * 20) for slot in range(200)], shapes))
    assert len(groups) >= 2 and sorted(s for _, g in groups for s, _ in g) == list(range(200))
    assert all(len(g) <= shapes.prompts(length, FRESH_PROMPT_TOKENS) for length, g in groups)
    assert len(groups[0][1]) == shapes.prompts(groups[0][0], FRESH_PROMPT_TOKENS), "as many as its length allows"
    kept = list(packed_kept_groups([(slot, [1] * 108, 100) for slot in range(300)], shapes, 1 << 16, None))
    assert len(kept) >= 2 and sorted(s for _, _, g in kept for s, _, _ in g) == list(range(300))
    assert all(len(g) <= shapes.prompts(q_len, KEPT_TURN_TOKENS) for q_len, _, g in kept)
