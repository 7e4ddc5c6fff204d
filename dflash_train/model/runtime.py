"""The project's fast runtimes for a DFlash drafter: the static (CUDA-graph) runtime and
its greedy device loop, and `spec_generate`, which picks it or the reference loop.

The exported model file (model/dflash.py) holds the model and the reference decoding loop
(`speculate`: growing caches, eager) that a user runs after `trust_remote_code` loading.
This module is the project's, never exported, and imports that file.

The static runtime. Every decode step has fixed shapes, so on a GPU each step is captured
once as a CUDA graph and replayed (one launch instead of hundreds of kernels from Python);
on a CPU the same step functions run eagerly. The target's K/V and the drafter's context
K/V live in preallocated buffers where slot i holds position i: a step writes its block's
K/V at the block's positions and masks by position instead of cropping, and the slots
past the committed tokens (rejected drafts, an earlier request) are hidden until a later
step overwrites them. Every step input is a fixed tensor filled in place. The buffers hold
`rows` requests side by side, each at its own positions: one row is `speculate_static`;
several are the evaluation's batched loop (eval/static_batched.py).

The target attends over all S slots under that mask. transformers' sdpa cannot take a mask and
grouped-query heads at once, so it copies each K/V head to its query heads first (`repeat_kv`,
every slot, every layer and step); `gqa="packed"` (`packed_gqa_attention`) stacks a K/V head's
query heads as rows of one query instead, the same arithmetic without the copies.

The drafter drafts the whole block of B slots; the target verifies its first
`verify_tokens` drafts (k, default all of a block's: B-1 for DFlash and DFlash2, B for
DSpark, whose slot 0 drafts too) with the anchor: a (rows, k+1) verify, fixed per runtime
like every other shape. Drafts are picked by the drafter's own `pick_drafts` (DFlash's
argmax, DFlash2's selector walk, DSpark's Markov loop), fixed shapes with no host read, so
on a GPU the greedy pick is inside the captured step.

Shapes: b rows, B block size, k verified drafts, S cache slots, V vocabulary.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin

from dflash_train.model.dflash import (
    FULL_ATTENTION,
    NO_CLOCK,
    SLIDING_ATTENTION,
    Sampling,
    SpecOutput,
    StepClock,
    check_request,
    check_verify_tokens,
    cut_after_stop,
    device_clock,
    first_token,
    rope_parameters,
    speculate,
    stalled,
    target_features,
)

GREEDY = Sampling()  # the device loop's pick: argmax, no generator
MIN_SLOTS = 1024  # cache slots: a power of two, at least this, so few requests rebuild
GRAPH_WARMUP_RUNS = 2  # eager runs on a side stream before capture, as CUDA graphs require
STATIC_ATTENTION = ("sdpa", "eager")  # the implementations that read our 4D additive masks
MAX_STOP_IDS = 8  # stop tokens the greedy device loop checks; more take the per-step loop
# A run of replayed steps is at most this share of what the remaining budget needs at the
# acceptance seen so far: steps past the end cost a whole step each, a host read between runs
# a few microseconds, so runs stay short of the end.
RUN_SHARE = 0.5
RUN_WITH_STOPS = 4  # with stop tokens, runs of at most this many steps (a read costs ~0.03 ms on an H100)
# How the target's attention serves grouped-query heads: "repeat" is transformers' sdpa path (with
# a mask it copies every K/V head to its r query heads, all S slots, every layer and step);
# "packed" stacks a K/V head's r query heads as rows of one query and reads K/V once.
GQA_PATHS = ("repeat", "packed")
PACKED_GQA = "dflash_packed_gqa"  # the packed path's name among transformers' attention functions


def _write_slots(buffer: torch.Tensor, write_at: torch.Tensor, states: torch.Tensor) -> None:
    """Write states (b, g, L, d) into buffer (b, g, S, d) at slots write_at: (L,) the same
    slots for every row (one row), or (b, L) each row's own."""
    if write_at.dim() == 1:
        buffer.index_copy_(2, write_at, states)
    else:
        buffer.scatter_(2, write_at[:, None, :, None].expand_as(states), states)


def _slot_index(positions: torch.Tensor) -> torch.Tensor:
    """positions (b, L) as `_write_slots` takes them: one row's (L,), or (b, L)."""
    return positions[0] if positions.shape[0] == 1 else positions


def static_unsupported(target) -> str | None:
    """Why the static runtime cannot drive `target`, or None when it can."""
    config = target.config
    impl = getattr(config, "_attn_implementation", None)
    if impl not in STATIC_ATTENTION:
        return f"attention implementation {impl!r} (the static runtime needs one of {list(STATIC_ATTENTION)})"
    kinds = set(getattr(config, "layer_types", None) or [FULL_ATTENTION])
    if kinds != {FULL_ATTENTION} or getattr(config, "use_sliding_window", False):
        return f"layer types {sorted(kinds)} (the static runtime serves full-attention targets only)"
    rope = rope_parameters(config).get("rope_type", "default")
    if rope in ("dynamic", "longrope"):  # they resize their tables from the positions' values
        return f"rope_type {rope!r} (its tables depend on the positions' values)"
    return None


def use_static(static: bool | None, target, device) -> bool:
    """Resolve `spec_generate(static=...)`: None is static on a GPU when the target allows it."""
    reason = static_unsupported(target)
    if static is None:
        return torch.device(device).type == "cuda" and reason is None
    if static and reason is not None:
        raise ValueError(f"static=True cannot serve this target: {reason}; use static=False")
    return bool(static)


class _SlotLayer(CacheLayerMixin):
    """One target layer's K/V in (b, g, S, d) buffers; a forward writes at `owner.write_at`."""

    is_compileable = True  # the buffers never move after the first write

    def __init__(self, owner):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states, value_states=None):
        b, g, _, d = key_states.shape
        values = key_states if value_states is None else value_states
        self.keys = key_states.new_zeros(b, g, self.owner.size, d)
        self.values = values.new_zeros(b, g, self.owner.size, values.shape[-1])
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        _write_slots(self.keys, self.owner.write_at, key_states)
        _write_slots(self.values, self.owner.write_at, value_states)
        return self.keys, self.values  # every slot: the mask decides which are seen

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.owner.size, 0

    def get_seq_length(self) -> int:
        return 0  # positions come from position_ids and masks from us: nothing reads a length

    def get_max_length(self) -> int:  # transformers 5.x
        return self.owner.size

    def get_max_cache_shape(self) -> int:  # transformers 4.57
        return self.owner.size


class SlotCache(Cache):
    """The target's K/V in `size` slots per layer (slot i holds position i)."""

    def __init__(self, num_layers: int, size: int):
        self.size = size
        self.write_at = None  # (L,) or (b, L) the slots the next forward writes: its tokens' positions
        super().__init__(layers=[_SlotLayer(self) for _ in range(num_layers)])


class SlotContextCache:
    """The drafter's context K/V in `size` slots per layer, the `ContextCache` interface:
    a forward writes its new context at `write_at` and reads every slot."""

    def __init__(self, size: int):
        self.size = size
        self.write_at = None  # (C,) or (b, C) positions of the forward's new context features
        self.keys: list = []
        self.values: list = []

    def read_and_append(self, layer: int, k_ctx: torch.Tensor, v_ctx: torch.Tensor):
        if layer == len(self.keys):
            self.keys.append(k_ctx.new_zeros(*k_ctx.shape[:2], self.size, k_ctx.shape[-1]))
            self.values.append(v_ctx.new_zeros(*v_ctx.shape[:2], self.size, v_ctx.shape[-1]))
        _write_slots(self.keys[layer], self.write_at, k_ctx)
        _write_slots(self.values[layer], self.write_at, v_ctx)
        return self.keys[layer], self.values[layer]  # (b, g, S, d)


class Replayable:
    """A step of no arguments that reads and writes only fixed tensors.

    Eager unless `capture`; then its first call warms it up on a side stream and captures
    it as a CUDA graph, and every call replays the graph. The step must be idempotent (the
    warm-up repeats the first call), or name in `state` the tensors it advances, and its
    results are overwritten by the next call.
    """

    def __init__(self, fn, device, capture: bool, state: tuple = ()):
        self.fn, self.device, self.graph, self.out = fn, torch.device(device), None, None
        self.capture = capture and self.device.type == "cuda"
        self.state = state  # tensors a step advances: put back after the warm-up runs

    def __call__(self):
        if not self.capture:
            return self.fn()
        if self.graph is None:
            with torch.cuda.device(self.device):
                saved = [t.clone() for t in self.state]
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(GRAPH_WARMUP_RUNS):
                        self.fn()
                    for t, before in zip(self.state, saved):
                        t.copy_(before)
                torch.cuda.current_stream().wait_stream(side)
                self.graph = torch.cuda.CUDAGraph()
                # thread_local: a CUDA call from another thread (a compile worker) does not void the capture.
                # Captured on the warm-up's stream: its cuBLAS workspace exists before the capture (on a
                # fresh capture stream a GEMM of the Qwen3-8B geometry at batch 1 failed inside it)
                with torch.cuda.graph(self.graph, stream=side, capture_error_mode="thread_local"):
                    self.out = self.fn()
        self.graph.replay()
        return self.out


def packed_gqa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """sdpa over grouped-query heads without copying K/V: query (b, h, L, d) as (b, g, r*L, d),
    the r query heads of each of the g K/V heads stacked (row j*L + i: head j of the group,
    token i); key/value (b, g, S, d); attention_mask (b, 1, r*L, S), built for the stacked rows.
    The same scores and softmax rows as repeating K/V r times; returns (b, L, h, d), None."""
    b, heads, length, _ = query.shape
    groups = key.shape[1]
    stacked = query.reshape(b, groups, heads // groups * length, query.shape[-1])
    out = F.scaled_dot_product_attention(stacked, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling)
    return out.view(b, heads, length, value.shape[-1]).transpose(1, 2).contiguous(), None


AttentionInterface.register(PACKED_GQA, packed_gqa_attention)


@contextmanager
def _attention_as(config, implementation: str):
    """``config`` names ``implementation`` as its attention for the block's forwards (the target's
    attention modules read it at every call), then its own again."""
    own = config._attn_implementation
    config._attn_implementation = implementation
    try:
        yield
    finally:
        config._attn_implementation = own


def _query_stack(target, gqa: str) -> int:
    """Query rows a position takes in the slot mask: r (query heads per K/V head) when packed."""
    if gqa not in GQA_PATHS:
        raise ValueError(f"gqa={gqa!r}: must be one of {list(GQA_PATHS)}")
    config = target.config
    if gqa == "repeat":
        return 1
    if config._attn_implementation != "sdpa":
        raise ValueError(f"gqa='packed' runs sdpa, but the target's attention is {config._attn_implementation!r}")
    return config.num_attention_heads // (getattr(config, "num_key_value_heads", None) or config.num_attention_heads)


def _causal_slot_mask(positions: torch.Tensor, slots: torch.Tensor, dtype) -> torch.Tensor:
    """(b, 1, L, S) additive: the query at position p sees slots 0..p, the tokens up to itself."""
    visible = slots[None, None, None, :] <= positions[:, None, :, None]
    return torch.zeros(visible.shape, dtype=dtype, device=slots.device).masked_fill(~visible, torch.finfo(dtype).min)


def _where(module: nn.Module) -> tuple:
    """Device and dtype of a module's first weight: a captured graph reads the weights there."""
    weight = next(module.parameters())
    return weight.device, weight.dtype


class TargetSlots:
    """The target over a `SlotCache`: a prefill of any length, and a step over `width`
    tokens a row at fixed `ids`/`positions` (rows, width) buffers (replayable). Features:
    of `layer_ids`. `gqa`: one of `GQA_PATHS`."""

    def __init__(self, target, size: int, width: int, layer_ids=(), graphs: bool = True, rows: int = 1,
                 gqa: str = "repeat"):
        device = target.get_input_embeddings().weight.device
        self.target, self.layer_ids, self.graphs, self.weights = target, list(layer_ids), graphs, _where(target)
        self.gqa, self.stack = gqa, _query_stack(target, gqa)
        self.cache = SlotCache(target.config.num_hidden_layers, size)
        self.slots = torch.arange(size, device=device)
        self.ids = torch.zeros(rows, width, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, width, dtype=torch.long, device=device)
        self.step = Replayable(lambda: self.forward(self.ids, self.positions), device, graphs)

    def forward(self, ids, positions, logits_to_keep: int = 0):
        """Logits (b, L, V) and features (b, L, n*H) or None; writes K/V at `positions` (b, L)."""
        self.cache.write_at = _slot_index(positions)
        # packed: a row per stacked query, head j's rows after head j-1's (`packed_gqa_attention`)
        mask = _causal_slot_mask(positions.repeat(1, self.stack), self.slots, self.target.dtype)
        packed = _attention_as(self.target.config, PACKED_GQA) if self.gqa == "packed" else nullcontext()
        with packed:
            out = self.target(ids, attention_mask=mask, position_ids=positions, past_key_values=self.cache,
                              use_cache=True, output_hidden_states=bool(self.layer_ids), logits_to_keep=logits_to_keep)
        return out.logits, target_features(out.hidden_states, self.layer_ids) if self.layer_ids else None

    def prefill(self, input_ids, logits_to_keep: int = 0):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        return self.forward(input_ids, positions, logits_to_keep)

    def fits(self, target, size: int, graphs: bool, rows: int = 1, gqa: str = "repeat") -> bool:
        """Still valid for `target`: the same module, dtype and device (the graphs read its
        weights where they were at capture), enough slots, the same capture choice, rows and gqa."""
        return (target is self.target and self.weights == _where(target) and size <= self.cache.size
                and graphs == self.graphs and rows == self.ids.shape[0] and gqa == self.gqa)


def _compiles_draft(drafter, graphs: bool, device) -> bool:
    """Whether the static runtime compiles `drafter`'s draft step: eval's compile_drafter sets
    `drafter.compile_static_draft`, and only captured graphs on a GPU use it."""
    return graphs and torch.device(device).type == "cuda" and getattr(drafter, "compile_static_draft", False)


def greedy_accepted(drafts: torch.Tensor, target_tokens: torch.Tensor, usable) -> torch.Tensor:
    """Accepted drafts per row (b,): the prefix of drafts (b, B-1) equal to the target's
    tokens (b, B) after them, within the first ``usable`` (an int, or (b, 1) per row)."""
    slots = torch.arange(drafts.shape[1], device=drafts.device)[None]
    return ((drafts == target_tokens[:, :-1]) & (slots < usable)).long().cumprod(1).sum(1)


def _slot_draft_masks(drafter, slots, block_pos, end) -> dict:
    """Per layer type (b, 1, B, S + B) bool: what each block slot sees (`end`: (b, 1), or
    None for a drafter that runs its whole block at every step).

    Context slots before the anchor's position hold committed tokens' features. Block slots
    at or past `end` (positions the budget can never commit) are hidden from the others,
    which makes a B-wide block compute what the dynamic runtime's narrowed last block does;
    a slot always sees itself, so no softmax row is empty.
    """
    width = block_pos.shape[1]
    see_ctx = (slots[None, None, :] < block_pos[:, :1, None]).expand(-1, width, -1)  # (b, B, S)
    own = torch.eye(width, dtype=torch.bool, device=slots.device)[None]
    seen = torch.ones_like(block_pos, dtype=torch.bool) if end is None else block_pos < end  # (b, B)
    see_block = seen[:, None, :] | own  # (b, B, B)
    masks = {FULL_ATTENTION: torch.cat([see_ctx, see_block.expand(see_ctx.shape[0], -1, -1)], -1)[:, None]}
    if SLIDING_ATTENTION in drafter.layer_types:
        window = drafter.config.sliding_window
        near = block_pos[:, :, None] - slots[None, None, :] < window  # (b, B, S)
        back = own.new_ones(width, width).tril() & ~own.new_ones(width, width).tril(-window)  # (B, B)
        masks[SLIDING_ATTENTION] = torch.cat([see_ctx & near, see_block & back], -1)[:, None]
    return masks


class StaticSpeculator:
    """The static runtime's buffers and replayable steps for one drafter and target.

    The draft step reads the block (b, B) plus the previous verify's k+1 features
    (`ctx_feats`, at `ctx_pos`), writes their context K/V and drafts; the verify step reads
    the anchor and the k verified drafts (`verify_width` slots) at their positions. One
    (b, W) buffer of ids and one of positions hold both, W the widest verify (B, or B + 1
    for DSpark): the block is its first B slots, the verify its first k+1. Only what the
    host decides between steps is filled in place. `rows` requests share every step, each
    at its own positions.
    """

    def __init__(self, drafter, target, size: int, graphs: bool = True, rows: int = 1,
                 verify_tokens: int | None = None, gqa: str = "repeat"):
        widest = drafter.drafts_per_block + 1
        self.verifier = TargetSlots(target, size, widest, drafter.target_layer_ids, graphs, rows, gqa)
        device, dtype = self.verifier.slots.device, target.dtype
        self.target, self.drafter, self.weights = target, drafter, _where(drafter)
        self.verify_width = width = check_verify_tokens(verify_tokens, widest) + 1
        self.context = SlotContextCache(size)
        self.offsets = torch.arange(widest, device=device)[None]
        self.end = torch.zeros(rows, 1, dtype=torch.long, device=device)  # per row: first position never committed
        self.ctx_feats = torch.zeros(rows, width, drafter.fc.in_features, dtype=dtype, device=device)
        self.ctx_pos = torch.zeros(rows, width, dtype=torch.long, device=device)
        # views made once (the buffers never move): the drafter's block (b, B), the verify (b, k+1)
        ids, positions = self.verifier.ids, self.verifier.positions
        self.block, self.block_pos = ids[:, : drafter.block_size], positions[:, : drafter.block_size]
        self.verified, self.verified_pos = ids[:, :width], positions[:, :width]
        self.verify_step = Replayable(lambda: self.verifier.forward(self.verified, self.verified_pos), device, graphs)
        # `drafter.compile_static_draft` (eval's compile_drafter): the fixed-shape draft step
        # compiled by torch.compile inside the captured graphs, fewer and fused kernels; its
        # drafts may differ from eager's by rounding, the committed tokens stay the target's.
        self.compiled = _compiles_draft(drafter, graphs, device)
        compiled = torch.compile(self.draft, dynamic=False) if self.compiled else None
        compiled_hidden = torch.compile(self.draft_hidden, dynamic=False) if self.compiled else None

        def draft(feats, ctx_pos):  # `self.draft` looked up at each call, as a step's code always is
            return (compiled or self.draft)(feats, ctx_pos)

        def hidden(feats, ctx_pos):
            return (compiled_hidden or self.draft_hidden)(feats, ctx_pos)
        self.draft_step = Replayable(lambda: draft(self.ctx_feats, self.ctx_pos), device, graphs)  # greedy drafts
        self.hidden_step = Replayable(lambda: hidden(self.ctx_feats, self.ctx_pos), device, graphs)  # sampling's
        # The greedy loop's state on the device (`advance`): each row's anchor, its position,
        # whether it has finished, its steps, per step its committed count, per position its token.
        self.mask_id = torch.zeros((), dtype=torch.long, device=device)
        self.has_stops = False  # the request's: `begin` sets it
        self.stop_ids = torch.full((MAX_STOP_IDS,), -1, dtype=torch.long, device=device)
        self.anchor = torch.zeros(rows, dtype=torch.long, device=device)
        self.start = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.first = torch.zeros_like(self.start)  # each row's first new token's position (`begin`)
        self.done = torch.zeros(rows, 1, dtype=torch.bool, device=device)
        self.steps = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.counts = torch.zeros(rows, size, dtype=torch.long, device=device)
        self.tokens = torch.zeros(rows, size, dtype=torch.long, device=device)
        advanced = (self.anchor, self.start, self.done, self.steps, self.counts, self.tokens, self.ctx_feats,
                    self.ctx_pos, ids, positions)
        self.greedy_step = Replayable(lambda: self.advance(lambda: draft(self.ctx_feats, self.ctx_pos)), device,
                                      graphs, state=advanced)

    def fits(self, drafter, target, size: int, graphs: bool, rows: int = 1, verify_tokens: int | None = None,
             gqa: str = "repeat") -> bool:
        return (drafter is self.drafter and self.weights == _where(drafter)
                and _compiles_draft(drafter, graphs, self.target.device) == self.compiled
                and check_verify_tokens(verify_tokens, drafter.drafts_per_block + 1) + 1 == self.verify_width
                and self.verifier.fits(target, size, graphs, rows, gqa))

    def draft_hidden(self, feats, ctx_pos) -> torch.Tensor:
        """The drafter's outputs for the block: (b, B, H). feats: (b, C, n*H) at ctx_pos (b, C)."""
        self.context.write_at = _slot_index(ctx_pos)
        end = self.end if self.drafter.narrows_last_block else None
        masks = _slot_draft_masks(self.drafter, self.verifier.slots, self.block_pos, end)
        noise = self.target.get_input_embeddings()(self.block)
        return self.drafter(noise, feats, torch.cat([ctx_pos, self.block_pos], 1), masks, self.context, True)

    def draft(self, feats, ctx_pos) -> torch.Tensor:
        """The greedy drafts of the verified slots: (b, k), picked the drafter's way."""
        hidden = self.draft_hidden(feats, ctx_pos)
        return self.drafter.pick_drafts(self.target, hidden, self.block[:, 0], self.verify_width - 1, GREEDY, None)[0]

    def fill_drafts(self, first_ctx, sampling: Sampling, generator) -> torch.Tensor | None:
        """Draft every row's verified slots 1..k in place, from ``first_ctx`` (the prompts'
        features and positions, eager) or else the previous verify's (a replayed step); the
        distributions they were drawn from (b, k, V) when sampling, else None."""
        if sampling.greedy:
            self.verified[:, 1:] = self.draft(*first_ctx) if first_ctx else self.draft_step()
            return None
        hidden = self.draft_hidden(*first_ctx) if first_ctx else self.hidden_step()
        drafts, probs = self.drafter.pick_drafts(self.target, hidden, self.block[:, 0], self.verify_width - 1,
                                                 sampling, generator)
        self.verified[:, 1:] = drafts
        return probs

    def set_block(self, anchor: torch.Tensor, start, mask_id: int) -> None:
        """[anchor, MASK, ...] at positions start, start+1, ...; anchor: (b,) on the device,
        start: an int (one row) or (b, 1) on the device."""
        self.verifier.ids.fill_(mask_id)
        self.block[:, :1].copy_(anchor.view(-1, 1))
        torch.add(self.offsets, start, out=self.verifier.positions)

    def begin(self, anchor: torch.Tensor, start: torch.Tensor, end: torch.Tensor, mask_id: int, stops) -> None:
        """The greedy loop's state for a new request: anchor (b,) at positions start (b, 1),
        the last new token's positions end (b, 1)."""
        if len(stops) > MAX_STOP_IDS:
            raise ValueError(f"{len(stops)} stop token ids: the device loop takes at most {MAX_STOP_IDS}")
        self.mask_id.fill_(mask_id)
        self.has_stops = bool(stops)
        self.stop_ids.fill_(-1)
        self.stop_ids[: len(stops)] = torch.tensor(sorted(stops), dtype=torch.long)
        self.anchor.copy_(anchor)
        self.start.copy_(start)
        self.end.copy_(end)
        self.done.copy_((start >= end) | (anchor[:, None, None] == self.stop_ids).any(-1))
        self.steps.zero_()
        self.first = start.clone()  # each row's first new token's position: where its answer starts
        self.tokens.scatter_(1, start, anchor[:, None])

    def advance(self, draft) -> None:
        """One greedy speculative step of every row, decided on the device with no host copy.

        Draft (``draft()``: the k greedy drafts (b, k)), verify them, accept the prefix
        the target agrees with within the row's budget, then the target's own token; cut
        after the first stop token. A row's committed tokens go to `tokens` at their
        positions, their count to `counts` at the row's step; the verify's features become
        the next draft's context. A finished row keeps its state (its block is recomputed,
        nothing recorded), so running more steps than needed changes no result.
        """
        width = self.verify_width
        slot = self.offsets[:, :width]  # (1, k+1)
        self.set_block(self.anchor, self.start, self.mask_id)
        self.verified[:, 1:] = draft()
        logits, feats = self.verifier.forward(self.verified, self.verified_pos)
        best = logits.argmax(-1)  # (b, k+1): the target's token after each verified slot
        usable = (self.end - self.start).clamp(max=width) - 1  # (b, 1) drafts the budget can commit
        count = greedy_accepted(self.verified[:, 1:], best, usable)[:, None] + 1  # (b, 1) accepted + the target's
        stop = (best[..., None] == self.stop_ids).any(-1) & (slot < count)  # (b, k+1)
        count = torch.minimum(count, torch.where(stop, slot, width).amin(1, keepdim=True) + 1) * ~self.done
        at = (self.start + 1 + slot).clamp(max=self.tokens.shape[1] - 1)  # (b, k+1) the committed tokens' positions
        self.tokens.scatter_(1, at, torch.where(slot < count, best, self.tokens.gather(1, at)))
        live = ~self.done
        self.counts.scatter_(1, self.steps, torch.where(live, count, self.counts.gather(1, self.steps)))
        self.steps += live
        self.anchor.copy_(torch.where(live[:, 0], best.gather(1, (count - 1).clamp(min=0))[:, 0], self.anchor))
        self.start += count
        self.done |= stop.any(1, keepdim=True) | (self.start >= self.end)
        self.ctx_feats.copy_(feats)
        self.ctx_pos.copy_(self.verified_pos)

    def run_greedy(self, first_ctx) -> None:
        """Steps until every row has finished: the first drafts from ``first_ctx`` (the
        prompts' features and positions, eager), then replayed `greedy_step`s in runs, the
        host reading four numbers a row between runs (the one device-to-host copy)."""
        self.advance(lambda: self.draft(*first_ctx))
        first = self.first[:, 0].tolist()
        while True:
            done, start, end, steps = torch.cat([self.done, self.start, self.end, self.steps], 1).T.tolist()
            self._check_progress(start, first, steps)
            if all(done):
                return
            per_step = max(1.0, sum(s - f for s, f in zip(start, first)) / max(1, sum(steps)))
            remaining = max(e - s for e, s, d in zip(end, start, done) if not d)
            # never more steps than the budget needs (a step commits at most k+1 tokens), or a
            # share of what the acceptance so far needs
            run = max(-(-remaining // self.verify_width), int(RUN_SHARE * remaining / per_step))
            if self.has_stops:  # a stop token can end a row any step: steps past it are wasted
                run = min(run, RUN_WITH_STOPS)
            for _ in range(run if self.start.is_cuda else 1):  # off a GPU reading the state costs nothing
                self.greedy_step()

    def _check_progress(self, start: list[int], first: list[int], steps: list[int]) -> None:
        """Every live step commits a token, so a row's position has moved at least once per
        step; a row behind that had a step commit none (read from the state the loop has
        just copied to the host: no extra sync unless it fails)."""
        for row, (s, f, n) in enumerate(zip(start, first, steps)):
            if s - f < n:
                raise stalled(self.counts[row, :n].tolist().index(0), row)

    def results(self) -> list[tuple[list[int], list[int]]]:
        """Each row's (new tokens, committed count per step) once `run_greedy` is done."""
        first, start, steps = self.first[:, 0].tolist(), self.start[:, 0].tolist(), self.steps[:, 0].tolist()
        tokens, counts = self.tokens.tolist(), self.counts.tolist()
        return [(row[f : s + 1], c[:n]) for row, c, f, s, n in zip(tokens, counts, first, start, steps)]


def static_runtime(owner: nn.Module, needed: int, fits, build):
    """The static runtime kept on `owner`, rebuilt (with more slots) when `fits(size)` fails."""
    size = max(MIN_SLOTS, 1 << (needed - 1).bit_length())
    runtime = owner.__dict__.get("_static_runtime")
    if runtime is None or not fits(runtime, size):
        owner.__dict__["_static_runtime"] = None  # free the old buffers and graphs first
        runtime = owner.__dict__["_static_runtime"] = build(size)
    return runtime


def verify_drafts_on_device(drafts, draft_probs, target_logits, sampling: Sampling, generator, usable: int):
    """`verify_drafts` on the device, with no host sync: accepted count and next token, 0-d tensors.

    Only the first `usable` drafts count (the rest lie past the budget). Sampling draws all
    uniforms at once and accepts the prefix where u < p/q; after a rejection at row i the
    token comes from the residual max(0, p - q) there, after `usable` acceptances from p:
    the same distribution as the sequential rule.
    """
    if sampling.greedy:
        target_tokens = target_logits.argmax(-1)  # (B,)
        accepted = greedy_accepted(drafts[None], target_tokens[None], usable)[0]
        return accepted, target_tokens.gather(0, accepted.view(1))[0]
    usable_rows = torch.arange(drafts.shape[0], device=drafts.device) < usable
    p = sampling.probs(target_logits)  # (B, V)
    if usable == 0:  # nothing was drafted: the target's own next token
        return torch.zeros((), dtype=torch.long, device=p.device), torch.multinomial(p[0], 1, generator=generator)[0]
    picked = drafts[:, None]
    ratio = p[:-1].gather(1, picked)[:, 0] / draft_probs.gather(1, picked)[:, 0]
    u = torch.rand(drafts.shape, generator=generator, device=p.device)
    accepted = ((u < ratio) & usable_rows).long().cumprod(0).sum()
    residual = (p[:-1] - draft_probs).clamp_min(0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[:-1])
    after = torch.where(accepted < usable, torch.cat([residual, p[-1:]]).index_select(0, accepted.view(1)),
                        p.index_select(0, accepted.view(1)))[0]
    return accepted, torch.multinomial(after / after.sum(), 1, generator=generator)[0]


@torch.inference_mode()
def speculate_static(model, target, input_ids, max_new_tokens, sampling, stop_token_ids, mask_token_id, generator,
                     clock=NO_CLOCK, graphs: bool = True, verify_tokens: int | None = None):
    """`speculate` with fixed shapes: every block is B wide, every verify k+1, and both caches
    are slot buffers.

    The first draft step reads the prompt's features (any length) eagerly; later ones read
    the previous verify's k+1 features. Greedy and untimed (`clock`), every step is decided on
    the device (`StaticSpeculator.advance`, one CUDA graph a step on a GPU) and the host
    reads the state only between runs of steps. Otherwise (sampling, or a clock that laps
    the parts of each step) each step copies one small tensor to the host (the accepted
    count and the tokens), which decides what is committed and when to stop.
    """
    mask_id = check_request(model, input_ids, mask_token_id)
    stops = set(stop_token_ids or [])
    device = input_ids.device
    prompt_len, width = input_ids.shape[1], model.drafts_per_block + 1  # the widest verify
    rt = static_runtime(model, prompt_len + max_new_tokens + width,
                        lambda rt, size: rt.fits(model, target, size, graphs, verify_tokens=verify_tokens),
                        lambda size: StaticSpeculator(model, target, size, graphs, verify_tokens=verify_tokens))
    checked = rt.verify_width  # the block's first slots, the ones the target verifies
    end = prompt_len + max_new_tokens - 1  # the last new token's position: no block slot there commits
    t0 = device_clock(device)
    logits, feats = rt.verifier.prefill(input_ids, logits_to_keep=1)
    anchor = first_token(logits[0, -1], sampling, generator).view(1)
    first_ctx = (feats, torch.arange(prompt_len, device=device)[None])
    if sampling.greedy and clock is NO_CLOCK and len(stops) <= MAX_STOP_IDS:
        rt.begin(anchor, torch.tensor([[prompt_len]], device=device), torch.tensor([[end]], device=device), mask_id,
                 stops)
        t1 = device_clock(device)
        rt.run_greedy(first_ctx)
        new, lengths = rt.results()[0]
        return SpecOutput.of_run(input_ids[0].tolist() + new, lengths, prompt_len, (t0, t1, device_clock(device)),
                                 clock, device)
    tokens = input_ids[0].tolist() + [int(anchor)]
    rt.end.fill_(end)
    t1 = device_clock(device)
    lengths = []
    while len(tokens) - prompt_len < max_new_tokens and tokens[-1] not in stops:
        clock.lap()
        start = len(tokens) - 1
        usable = min(checked, end - start) - 1  # drafts the budget can commit, as in the dynamic runtime
        rt.set_block(anchor, start, mask_id)
        draft_probs = None
        if usable > 0:
            draft_probs = rt.fill_drafts(first_ctx, sampling, generator)
            draft_probs = None if draft_probs is None else draft_probs[0]  # (k, V)
        first_ctx = None
        clock.lap("draft")
        logits, step_feats = rt.verify_step()
        clock.lap("verify")
        accepted, bonus = verify_drafts_on_device(rt.verified[0, 1:], draft_probs, logits[0], sampling, generator,
                                                  usable)
        clock.lap("accept")
        host = torch.cat([accepted.view(1), bonus.view(1), rt.verified[0, 1:]]).tolist()  # the step's one sync
        clock.lap("host")
        committed = cut_after_stop(host[2 : 2 + host[0]] + [host[1]], stops)
        if not committed:
            raise stalled(len(lengths))
        tokens += committed
        lengths.append(len(committed))
        # the next draft step writes these k+1 features' context K/V; its mask shows the committed ones
        rt.ctx_feats.copy_(step_feats)
        rt.ctx_pos.copy_(rt.verified_pos)
        anchor = bonus.view(1)
        clock.lap("bookkeeping")
    return SpecOutput.of_run(tokens, lengths, prompt_len, (t0, t1, device_clock(device)), clock, device)


def spec_generate(drafter, target, input_ids: torch.LongTensor, max_new_tokens: int, temperature: float = 0.0,
                  top_p: float = 1.0, top_k: int = 0, stop_token_ids=None, mask_token_id: int | None = None,
                  return_stats: bool = False, generator: torch.Generator | None = None, time_steps: bool = False,
                  static: bool | None = None, verify_tokens: int | None = None):
    """`DFlashDraftModel.spec_generate` (batch 1) with the choice of runtime.

    static: the fixed-shape runtime (`speculate_static`: preallocated caches, each step a
    CUDA graph on a GPU) or, False, the reference growing-cache loop (`speculate`, what the
    exported model file runs). None picks static on a GPU when the target allows it
    (`static_unsupported`). verify_tokens: drafts verified per step (None: all B-1).
    """
    drafter.eval()
    device = input_ids.device
    check_verify_tokens(verify_tokens, drafter.drafts_per_block + 1)
    run = speculate_static if use_static(static, target, device) else speculate
    result = run(drafter, target, input_ids, max_new_tokens, Sampling(temperature, top_p, top_k), stop_token_ids,
                 mask_token_id, generator, StepClock(device) if time_steps else NO_CLOCK,
                 verify_tokens=verify_tokens)
    return result if return_stats else result.output_ids
