"""The shapes of the generation engine's prefill forwards (data_gen/engine.py): which prompts
go into one forward and how they are laid out.

  * fresh prompts, right padded: rows of similar lengths (`prefill_groups`);
  * fresh prompts packed end to end in one row (`packed_groups`, `pack_fresh`);
  * next turns after what their cache rows hold, right padded (`kept_groups`) or packed
    (`packed_kept_groups`, `pack_kept`).

With CUDA graphs (one a shape) the shapes are rounded up to a few buckets (`Shapes`). Pure
Python on host lists: the engine copies what these build to the device in one transfer.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

# Prompt tokens (padding included) per prefill forward: bounds its activations.
PREFILL_TOKENS = 16384
# A prefill after kept prefixes (kept_groups): cache columns gathered (rows times span) and
# (query, column) pairs masked per KV head (rows times new tokens times span) a forward.
KEPT_COLUMNS = 1 << 19
KEPT_SCORES = 1 << 24
# With CUDA graphs a prefill forward's rows and widths are rounded up to powers of two, its
# width to BUCKET_WIDTH at least, a kept group's span to BUCKET_SPAN at least (Shapes).
BUCKET_WIDTH = 16
BUCKET_SPAN = 256
# A packed prefill's tokens a forward: PREFILL_TOKENS with flash attention (half precision on a
# GPU), else at most PACKED_DENSE_TOKENS (SDPA under a dense mask of every (query, key) pair);
# with buckets its length a power of two from PACKED_MIN up to PACKED_STEP, then a multiple of it.
PACKED_DENSE_TOKENS = 2048
PACKED_MIN = 128
PACKED_STEP = 2048
# Next turns packed (after what their rows hold): the cache entries a forward gathers with flash
# attention, and without it the (query, key) pairs of its dense mask.
PACKED_KEYS = 1 << 16
PACKED_DENSE_PAIRS = 1 << 22
# Flash attention's variable-length kernel launches (longest / 128) x sequences x heads programs,
# and a CUDA graph fixes both numbers for a shape; programs past a prompt's end exit at once, at
# about a nanosecond each (benchmarks/packed_flash_grid.py, one H200: a layer's call on 2,048
# tokens of 6 prompts took 203 us with 513 sequences and the row's length as the longest, 60 us
# with its own). So a packed forward of L tokens passes as its longest what no prompt or padding
# exceeds (Shapes.longest), and holds at most max(PACKED_FEW, L // FRESH_PROMPT_TOKENS) fresh
# prompts (KEPT_TURN_TOKENS: next turns), a slot each at most (Shapes.prompts): a group of
# shorter ones is split. A fresh prompt's chat
# template alone is about 30 tokens; a next turn (the answer's end, the user's turn, the
# assistant's start) averaged 49 on issue 39's job.
PACKED_FEW = 16
FRESH_PROMPT_TOKENS = 32
KEPT_TURN_TOKENS = 16


def pow2(n: int) -> int:
    """The least power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class Shapes:
    """The shapes of prefill forwards: as their rows need (eager), or with `buckets` (CUDA
    graphs, one a shape) rounded up to a few: rows and widths powers of two, widths from
    BUCKET_WIDTH, kept spans powers of two from BUCKET_SPAN; within a row's `columns`."""

    buckets: bool
    columns: int  # cache columns a row has
    packed_most: int = PREFILL_TOKENS  # the longest packed forward but for a longer prompt alone
    slots: int | None = None  # the engine's slots: a packed forward's prompts at most (None: no bound)

    def rows(self, n: int, most: int | None = None) -> int:
        if not self.buckets:
            return n
        return pow2(n) if most is None else min(pow2(n), most)

    def width(self, w: int) -> int:
        return min(self.columns, max(BUCKET_WIDTH, pow2(w))) if self.buckets else w

    def packed(self, n: int) -> int:
        """The length of a packed forward of n tokens: n, or with buckets a power of two of
        PACKED_MIN tokens at least up to PACKED_STEP, then a multiple of PACKED_STEP."""
        if not self.buckets:
            return n
        return max(PACKED_MIN, pow2(n)) if n <= PACKED_STEP else -(-n // PACKED_STEP) * PACKED_STEP

    def prompts(self, length: int, tokens_each: int) -> int:
        """The most prompts (or next turns) a packed forward of `length` tokens holds: one every
        `tokens_each` tokens (PACKED_FEW at least), a slot each at most; its flash attention's
        sequences are one more (the padding)."""
        most = max(PACKED_FEW, length // tokens_each)
        return most if self.slots is None else min(self.slots, most)

    def longest(self, length: int) -> int:
        """What no sequence of a packed forward of `length` new tokens is longer than: a prompt
        (or a next turn) fits its cache row, the padding after them is under PACKED_STEP
        (`packed`)."""
        return min(length, max(self.columns, PACKED_STEP))

    def span(self, s: int) -> int:
        """Cache columns read by a group of rows holding up to s tokens: a multiple of 16 (the
        memory-efficient kernel's mask alignment), or a bucket."""
        return min(self.columns, max(BUCKET_SPAN, pow2(s)) if self.buckets else -(-s // 16) * 16)


def pad_rows(packed: list[list[int]], rows: int) -> list[list[int]]:
    """A group's packed rows padded to `rows` with copies of its first: a copy writes what the
    first writes, so the forward's result is the group's."""
    return packed + [packed[0]] * (rows - len(packed))


def prefill_groups(todo: list[tuple[int, list[int]]], shapes: Shapes) -> Iterator[tuple[int, int, list]]:
    """(rows, width, group) of the forwards that prefill fresh rows (slot, tokens): longest first,
    so a group holds similar lengths and little padding, each at most PREFILL_TOKENS tokens wide
    in all (one row at least); `rows` and `width` the forward's shape (`shapes`), at least the
    group's rows and its longest row."""
    todo = sorted((r for r in todo if r[1]), key=lambda r: len(r[1]))
    while todo:
        width = shapes.width(len(todo[-1][1]))
        most = max(1, PREFILL_TOKENS // width)
        n = min(len(todo), most)
        group, todo = todo[-n:], todo[:-n]
        yield shapes.rows(n, most), width, group


def packed_groups(todo: list[tuple[int, list[int]]], shapes: Shapes) -> Iterator[tuple[int, list]]:
    """(length, group) of the packed forwards that prefill fresh rows (slot, tokens): longest
    first, each group as many prompts as fit in `shapes.packed_most` tokens (a longer prompt
    alone) and `shapes.prompts` allows its length, `length` its bucketed length (shapes.packed)."""
    todo = sorted((r for r in todo if r[1]), key=lambda r: -len(r[1]))
    while todo:
        group, total = [todo[0]], len(todo[0][1])
        rest = []
        for r in todo[1:]:  # first fit, longest first
            n = total + len(r[1])  # the cap is a final length's: lengths only grow, and it with them
            if n <= shapes.packed_most and len(group) < shapes.prompts(shapes.packed(n), FRESH_PROMPT_TOKENS):
                group.append(r)
                total = n
            else:
                rest.append(r)
        todo = rest
        yield shapes.packed(total), group


def pack_fresh(group: list[tuple[int, list[int]]], length: int, columns: int) -> list[list[int]]:
    """The (5, length) rows of a packed forward (_packed_forward): tokens, positions, slots,
    cache columns, and where each token's prompt starts in the row. The padding after the
    prompts is a prompt of its own, whose keys/values go to the last cache column of the
    group's first slot (no fed token is ever there: see data_gen/engine.py, _after_prefix)."""
    tokens, positions, slots, starts = [], [], [], []
    for slot, t in group:
        starts += [len(tokens)] * len(t)
        tokens += t
        positions += range(len(t))
        slots += [slot] * len(t)
    pad = length - len(tokens)
    starts += [len(tokens)] * pad
    return [tokens + [0] * pad, positions + [0] * pad, slots + [group[0][0]] * pad, positions + [columns - 1] * pad,
            starts]


def packed_kept_groups(todo: list[tuple[int, list[int], int]], shapes: Shapes, most_keys: int,
                        most_pairs: int | None) -> Iterator[tuple[int, int, list]]:
    """(new tokens' length, keys' length, group) of the packed forwards that prefill next turns
    (slot, tokens, start: the row holds tokens[:start]): the longest rows first, first fit, a
    group's new tokens at most `shapes.packed_most`, the cache entries it reads (each row's
    tokens) at most `most_keys` and, when given, their product at most `most_pairs`, its rows as
    many as `shapes.prompts` allows its new tokens' length (one row at least); the lengths
    bucketed (shapes.packed), the keys' at least the new tokens' padding longer than theirs (a
    padding query always sees a padding key)."""
    todo = sorted((r for r in todo if len(r[1]) > r[2]), key=lambda r: -len(r[1]))
    while todo:
        group, q, k, rest = [todo[0]], len(todo[0][1]) - todo[0][2], len(todo[0][1]), []
        for r in todo[1:]:
            q2, k2 = q + len(r[1]) - r[2], k + len(r[1])
            if (q2 <= shapes.packed_most and k2 <= most_keys and (most_pairs is None or q2 * k2 <= most_pairs)
                    and len(group) < shapes.prompts(shapes.packed(q2), KEPT_TURN_TOKENS)):
                group.append(r)
                q, k = q2, k2
            else:
                rest.append(r)
        todo = rest
        q_len = shapes.packed(q)
        yield q_len, shapes.packed(k + q_len - q), group


def pack_kept(group: list[tuple[int, list[int], int]], q_len: int, k_len: int, columns: int) -> list[int]:
    """The flat buffer of a packed next-turn forward (_packed_kept_forward): for the new tokens
    their ids, positions, slots and conversation (0, 1, ...), q_len each; for the keys (each
    row's columns up to its last new token) their slots, columns and conversation, k_len each.
    The padding of each side is one more conversation, in the last column of the group's
    first slot (no fed token is ever there: see data_gen/engine.py, _after_prefix)."""
    tokens, positions, slots, seq, key_slots, key_cols, key_seq = [], [], [], [], [], [], []
    for i, (slot, t, start) in enumerate(group):
        tokens += t[start:]
        positions += range(start, len(t))
        slots += [slot] * (len(t) - start)
        seq += [i] * (len(t) - start)
        key_slots += [slot] * len(t)
        key_cols += range(len(t))
        key_seq += [i] * len(t)
    pad_q, pad_k, last, n = q_len - len(tokens), k_len - len(key_slots), columns - 1, len(group)
    first = group[0][0]
    return (tokens + [0] * pad_q + positions + [last] * pad_q + slots + [first] * pad_q + seq + [n] * pad_q
            + key_slots + [first] * pad_k + key_cols + [last] * pad_k + key_seq + [n] * pad_k)


def kept_groups(todo: list[tuple[int, list[int], int]], shapes: Shapes) -> Iterator[tuple[int, int, int, list]]:
    """(rows, width, span, group) of the forwards that prefill rows (slot, tokens, start) after
    the tokens[:start] their cache rows hold: longest rows first, so that a group's rows read
    similar spans of cache; a group gathers at most KEPT_COLUMNS cache columns (rows times its
    span, the longest row's length rounded up by `shapes`), feeds at most PREFILL_TOKENS tokens
    (rows times its width, the most new tokens of a row, rounded up) and masks at most
    KEPT_SCORES (query, column) pairs of a KV head (rows times width times span), one row at
    least; `rows` the forward's rows (`shapes`: at least the group's)."""
    todo = sorted((r for r in todo if len(r[1]) > r[2]), key=lambda r: len(r[1]), reverse=True)
    while todo:
        span = shapes.span(len(todo[0][1]))
        n = width = 0
        for _, tokens, start in todo:
            wider = shapes.width(max(width, len(tokens) - start))
            rows = shapes.rows(n + 1)
            if n and (rows * span > KEPT_COLUMNS or rows * wider > PREFILL_TOKENS or rows * wider * span > KEPT_SCORES):
                break
            n, width = n + 1, wider
        yield shapes.rows(n), width, span, todo[:n]
        todo = todo[n:]
