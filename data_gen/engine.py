"""`engine` generator: continuous batching over a fixed KV cache, decode steps as CUDA graphs.

A fixed batch of `batch_size` slots, one row of a preallocated KV cache each (the layout of
transformers' StaticCache, but written per row: every slot is at its own position). A
slot whose answer ends (a stop token, or max_new_tokens) takes the next queued prompt at the
next sync, so long answers never hold a batch. The model is the target's own HF forward,
called with per-row `position_ids` and an attention function registered under
ATTENTION_NAME (transformers' AttentionInterface), which writes the new keys/values into the
slot rows and attends over them:
  * prefill: the new prompts, causal attention over the prompts themselves, right padded
    (transformers' SDPA function) or packed end to end in one row (backend.prefill; flash
    attention's variable-length kernel on a GPU); all but each prompt's last token, whose
    logits come from the first decode step, so the prefill needs no logits. A conversation's
    next turn takes its last answer's slot when free and prefills only what follows the tokens
    the row still holds, its queries attending over the row's cache (packed too: each row's
    new tokens over its gathered cache entries);
  * decode: one token per slot, attending over its own cache row (data_gen/engine_attention.py,
    by `backend.attention`): `sdpa` over the first `width` cache columns of every row with a
    per-row visibility mask, `width` covering every busy row (on CUDA a multiple of
    WIDTH_STEP); `flex` over the blocks of its row that hold its keys, whatever the others hold.
The decode step (forward, token choice, stop detection, bookkeeping) runs on the device
without a host sync; on CUDA each width is captured once as a CUDA graph and replayed (flex
needs one width: the whole row). So are the prefill forwards, whose shapes on CUDA are rounded
up to a few buckets (rows and widths powers of two; a group padded with copies of its first
row): eager the first time a shape comes, captured the second, replayed after. An eager
forward of a 24-layer target is about 1,400 operators the host issues one by one, and the
device waited for them (benchmarks/engine-host-cost-cpu-2026-11-28). The host reads the
slots every `sync_steps` steps (backend.sync_steps; by default STEPS_PER_SYNC on CUDA), one
chunk behind the device.

Nothing is shared between slots: a prompt's answer does not depend on the prompts beside it
(up to floating-point rounding of the attention over a wider padded range).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import warnings
from collections import Counter, deque
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from data_gen.config import (COMPILE_REGIONS, ENGINE_ATTENTIONS, ENGINE_PREFILLS, BackendConfig, SamplingConfig,
                             engine_attention_for)
from data_gen.engine_attention import (block_mask, decode_attention, packed_attention, packed_bounds, packed_flash,
                                       packed_kept_attention, sequence_bounds)
from data_gen.engine_prefill import (FRESH_PROMPT_TOKENS, KEPT_TURN_TOKENS, PACKED_DENSE_PAIRS, PACKED_DENSE_TOKENS,
                                     PACKED_KEYS, PREFILL_TOKENS, Shapes, kept_groups, pack_fresh, pack_kept, packed_groups,
                                     packed_kept_groups, pad_rows, prefill_groups)
from data_gen.generators import Completion, Progress, past
from data_gen.sampling import sample_tokens, uniform_stream
from dflash_train.model.target import TargetModel, decoder_layers

ATTENTION_NAME = "dflash_engine"
STEP_KWARG = "dflash_engine_step"
# Attention widths are multiples of this: one CUDA graph each.
WIDTH_STEP = 256
# Decode steps per chunk between two snapshots of the slots (see GenerationEngine._loop):
# a chunk must outlast the host's work on a snapshot (mostly launching a prefill), and a
# finished row idles up to two chunks.
STEPS_PER_SYNC = 8


@dataclass
class _Step:
    """What the attention function needs besides q, k, v (passed as a model kwarg)."""

    cache_k: list[torch.Tensor]  # per layer (B, Hkv, S, D)
    cache_v: list[torch.Tensor]
    rows: torch.Tensor | None = None  # prefill: the slots the prompts go to, (n,)
    # prefill after a kept prefix, built once a forward (not by each layer): each fed token's
    # position (n, T), the index of its cache entries (rows (n, 1), every head, columns (n, T)),
    # and the cache columns the group reads (the longest row's end)
    fed: torch.Tensor | None = None
    write: tuple | None = None
    span: int = 0
    pos: torch.Tensor | None = None  # decode: each slot's position, (B,)
    live: torch.Tensor | None = None  # decode: the slots with an answer going on, (B,)
    width: int = 0  # decode: cache columns attended (sdpa)
    attention: str = "sdpa"  # decode: backend.attention
    masks: dict | None = None  # decode and kept-prefix prefill: the step's masks by sliding window (None: full)
    # packed prefill: each token's slot, cache column and the index its prompt starts at in the row, (T,)
    # each, where the prompts begin (packed_bounds) and what no prompt is longer than (Shapes.longest)
    packed: tuple | None = None
    # next turns packed: the new tokens' slots, positions and conversations (T,) each, the keys'
    # slots, columns and conversations (Tk,) each, and the two sides' sequence_bounds with what no
    # conversation's new tokens exceed (Shapes.longest)
    kept_packed: tuple | None = None
    # a decode step's one layer (backend.compile_region=layer): that layer's cache (k, v), so its
    # compiled code never reads the layer's index, and one graph serves the whole stack
    layer_cache: tuple | None = None

    @property
    def decoding(self) -> bool:
        return self.pos is not None


def _layer_step(index: int, eager, compiled, *args, **kwargs):
    """A decoder layer's forward with backend.compile_region=layer: compiled in a decode step
    (given that layer's cache alone), eager in a prefill, whose shapes vary."""
    step = kwargs.get(STEP_KWARG)
    if step is None or not step.decoding:
        return eager(*args, **kwargs)
    kwargs[STEP_KWARG] = replace(step, layer_cache=(step.cache_k[index], step.cache_v[index]))
    return compiled(*args, **kwargs)


def engine_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask, scaling: float | None = None, dropout: float = 0.0,
                     sliding_window: int | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """The AttentionInterface function of the engine's private model copy.
    query (b, Hq, T, D), key/value (b, Hkv, T, D), already rotated; returns (b, T, Hq, D)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    step: _Step = kwargs.pop(STEP_KWARG)
    k_cache, v_cache = step.layer_cache or (step.cache_k[module.layer_idx], step.cache_v[module.layer_idx])
    if step.fed is not None:
        return _after_prefix(module, query, key, value, k_cache, v_cache, step, scaling, sliding_window), None
    if step.kept_packed is not None:
        slots, pos, seq, key_slots, key_cols, key_seq, bounds = step.kept_packed
        k_cache[slots, :, pos] = key[0].transpose(0, 1)  # the new tokens' entries, then every key read
        v_cache[slots, :, pos] = value[0].transpose(0, 1)
        keys, values = k_cache[key_slots, :, key_cols], v_cache[key_slots, :, key_cols]  # (Tk, Hkv, D)
        out = packed_kept_attention(query, keys, values, seq, key_seq, pos, key_cols, bounds, sliding_window,
                                    scaling, step.masks)
        return out.transpose(1, 2).contiguous(), None
    if step.packed is not None:
        slots, columns, starts, bounds, longest = step.packed
        k_cache[slots, :, columns] = key[0].transpose(0, 1)  # (T, Hkv, D) into the (slot, :, column) entries
        v_cache[slots, :, columns] = value[0].transpose(0, 1)
        out = packed_attention(query, key, value, starts, bounds, longest, sliding_window, scaling, step.masks)
        return out.transpose(1, 2).contiguous(), None
    if step.rows is not None:
        length = query.shape[2]
        k_cache[step.rows, :, :length] = key
        v_cache[step.rows, :, :length] = value
        mask = None
        if sliding_window is not None and sliding_window < length:
            i = torch.arange(length, device=query.device)
            mask = ((i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - sliding_window))[None, None]
        return sdpa_attention_forward(module, query, key, value, mask, dropout=0.0, scaling=scaling,
                                      is_causal=mask is None)
    b, hq, _, d = query.shape
    hkv = key.shape[1]
    # Indexed writes, not scatter_: compiled, a scatter into the cache became a copy of the
    # whole cache a layer (inductor writes index_put in place).
    slots = torch.arange(b, device=query.device)
    k_cache[slots, :, step.pos] = key[:, :, 0]
    v_cache[slots, :, step.pos] = value[:, :, 0]
    # GQA without repeating the cache: a slot's query heads of one KV head are its queries.
    q = query.reshape(b, hkv, hq // hkv, d)  # (B, Hkv, G, D)
    out = decode_attention(step.attention, q, k_cache, v_cache, step.pos, step.live, step.width, sliding_window,
                           scaling, step.masks)
    return out.reshape(b, 1, hq, d), None


def _after_prefix(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, step: _Step, scaling: float | None,
                  sliding_window: int | None) -> torch.Tensor:
    """Prefill of prompts whose first tokens' keys/values are in their rows already
    (the same conversation's earlier turn): the new tokens' keys/values go in after them, and
    each new query attends over its row's cache up to itself. Right-padded; a padding token
    writes into the row's last column, which no fed token ever holds (an answer's last token
    is never fed).

    Grouped-query attention is folded as in decoding (data_gen/engine_attention.py): the G
    query heads of a KV head are G x T queries of that head, so the rows' cache columns are
    read as they are, never repeated per query head. (Masked, SDPA's enable_gqa takes its math
    kernel, so transformers' SDPA path repeats the KV heads instead: a copy of every row's span
    per query head, 7 for Qwen2.5-0.5B.) The mask, additive (n, 1, G x T, span), is built by
    the first layer and shared by the others; the positions and write indices come built with
    `step` (per layer they were a fifth of the forward's operators)."""
    n, hq, length, d = query.shape
    hkv = key.shape[1]
    k_cache[step.write] = key.transpose(1, 2)  # (n, T, Hkv, D) into the (row, :, column) entries
    v_cache[step.write] = value.transpose(1, 2)
    k = k_cache[:, :, :step.span].index_select(0, step.rows)  # (n, Hkv, span, D)
    v = v_cache[:, :, :step.span].index_select(0, step.rows)
    mask = step.masks.get(sliding_window)
    if mask is None:
        columns = torch.arange(step.span, device=query.device)
        seen = columns[None, None] <= step.fed[:, :, None]  # (n, T, span)
        if sliding_window is not None:
            seen &= columns[None, None] > step.fed[:, :, None] - sliding_window
        groups = hq // hkv
        # Additive, in the queries' dtype: a boolean mask would be converted by every layer's call.
        hidden = torch.zeros(n, 1, groups, length, step.span, dtype=query.dtype, device=query.device)
        hidden.masked_fill_(~seen[:, None, None], torch.finfo(query.dtype).min)
        mask = step.masks[sliding_window] = hidden.view(n, 1, groups * length, step.span)
    q = query.reshape(n, hkv, hq // hkv * length, d)  # head h = j * G + i of KV head j: rows i*T..i*T+T-1
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)  # (n, Hkv, G*T, D)
    return out.reshape(n, hq, length, d).transpose(1, 2).contiguous()  # (n, T, Hq, D)


def _compile_layers(model: nn.Module) -> list[tuple[nn.Module, object]]:
    """backend.compile_region=layer: each decoder layer's decode forward compiled (one graph
    for the stack: the layers' code and shapes are one, their weights and caches its inputs).
    Returns each layer with its eager forward, to put back if the step does not compile."""
    eager = [(layer, layer.forward) for layer in decoder_layers(model)]
    for i, (layer, forward) in enumerate(eager):
        layer.forward = functools.partial(_layer_step, i, forward, torch.compile(forward, dynamic=False, fullgraph=True))
    return eager


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, engine_attention)


def _private_model(model: nn.Module) -> nn.Module:
    """The model with its own config (attention set to the engine's) and the same weights:
    a tree of shallow module copies, so the caller's model keeps its attention."""
    config = copy.deepcopy(model.config)
    config._attn_implementation = ATTENTION_NAME
    shared = model.config

    def clone(module: nn.Module) -> nn.Module:
        new = copy.copy(module)
        new._modules = {name: clone(child) if child is not None else None for name, child in module._modules.items()}
        if getattr(module, "config", None) is shared:
            new.config = config
        return new

    return clone(model)


def _kv_shape(config) -> tuple[int, int]:
    """(KV heads, head dim) of the target's attention layers."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return getattr(config, "num_key_value_heads", None) or heads, head_dim


class GenerationEngine:
    """Continuous-batching generation with a fixed KV cache of `batch_size` rows of
    `max_len` positions (prompt + answer). Queue prompts with `submit`; `drain` yields
    (key, Completion) as answers end, and a consumer may submit more while draining."""

    def __init__(self, target: TargetModel, batch_size: int, max_len: int, sampling: SamplingConfig,
                 stop_ids: list[int], cuda_graphs: bool = True, sync_steps: int | None = None,
                 attention: str = "auto", buckets: bool | None = None, compile: bool | None = None,
                 prefill: str = "auto", compile_region: str = COMPILE_REGIONS[0]):
        if compile_region not in COMPILE_REGIONS:
            raise ValueError(f"compile_region={compile_region!r}: expected one of {list(COMPILE_REGIONS)}")
        if attention not in ENGINE_ATTENTIONS:
            raise ValueError(f"attention={attention!r}: expected one of {list(ENGINE_ATTENTIONS)}")
        if prefill not in ENGINE_PREFILLS:
            raise ValueError(f"prefill={prefill!r}: expected one of {list(ENGINE_PREFILLS)}")
        if sync_steps is not None and sync_steps < 1:
            raise ValueError(f"sync_steps={sync_steps}: expected an integer >= 1, or None for the default")
        _register_attention()
        self.device = target.device
        self.attention = engine_attention_for(self.device.type) if attention == "auto" else attention
        if compile and self.attention != "flex":
            raise ValueError(f"compile=True needs the flex decode attention (attention={self.attention!r}): sdpa's "
                             "widths would each compile")
        if compile is None:  # auto: where it was measured (issue 39's job, one H200: 36.5K tokens/s against 29.2K)
            compile = self.device.type == "cuda" and self.attention == "flex"
        # The decode step, compiled (inside its CUDA graph on a GPU: fused kernels rather than
        # the ~60 an eager layer issues), or as it is. Compiled in two parts, the forward and the
        # token choice: the forward's code depends on the cache's shape alone, so engines of one
        # cache shape share it whatever they sample (the magpie writer's and the answers',
        # data_gen/pipeline.py Generators.build); compiled whole, each engine's step took 33-44 s
        # on a machine's first run (one H200, benchmarks/engine_compile_cost.py). The forward is
        # compiled a decoder layer at a time (compile_region=layer: one graph for the stack,
        # 16 s cold against 48 for the whole forward) or whole (model).
        self.model = _private_model(target.model)
        self._compiled = None
        self._eager_layers = []  # (layer, its eager forward) while the layers are compiled
        if compile:
            if compile_region == "layer":
                self._eager_layers = _compile_layers(self.model)
            self._compiled = (self._logits if compile_region == "layer" else
                              torch.compile(self._logits, dynamic=False, fullgraph=True),
                              torch.compile(self._choose, dynamic=False, fullgraph=True))
        self._step = self._decode_compiled if compile else self._decode
        self.sampling = sampling
        self.batch_size, self.max_new = batch_size, sampling.max_new_tokens
        self.max_len = max_len
        self.layers = len(decoder_layers(self.model))
        # the attention layers' sliding windows (None: the whole row)
        self._windows = {getattr(m, "sliding_window", None) for m in self.model.modules() if hasattr(m, "layer_idx")}
        self.graphs: dict[int, torch.cuda.CUDAGraph] | None = {} if cuda_graphs and self.device.type == "cuda" else None
        self._pool = None
        self._streams = None  # (warm-up, capture) streams, made at the first capture
        # Prefill forwards: their shapes (bucketed with graphs: a few shapes, one graph each),
        # the graphs by shape with their input buffer, the shapes run once, and how the forwards ran.
        # (`buckets`: bucketed shapes whether or not there are graphs; tests run them eagerly.)
        flash = packed_flash(torch.empty(0, dtype=target.model.dtype, device=self.device))
        self._flash = flash
        # auto: packed where flash attention takes the packed rows (backend.prefill)
        self.prefill = ("packed" if flash else "padded") if prefill == "auto" else prefill
        self.shapes = Shapes(self.graphs is not None if buckets is None else buckets, max_len,
                             PREFILL_TOKENS if flash else PACKED_DENSE_TOKENS, batch_size)
        self.prefill_graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._prefill_seen: set[tuple] = set()
        self.prefill_counts: Counter = Counter()
        # Off CUDA the host waits for every step anyway: it reads the slots after each.
        default = STEPS_PER_SYNC if self.device.type == "cuda" else 1
        self.sync_steps = default if sync_steps is None else sync_steps
        self.queue: deque = deque()
        # The host's view of the slots: the request in each, its position as of the last
        # snapshot read, and the first snapshot that shows it.
        self.slot_key: list[Hashable | None] = [None] * batch_size
        self.slot_pos = [0] * batch_size
        self.slot_since = [0] * batch_size
        # Each slot's prompt, and after its answer ends (key, the tokens whose keys/values the row
        # still holds): the same conversation's next turn takes that slot and prefills only what
        # follows the tokens it shares with them; _slot_of: a key's slot kept so.
        self.slot_prompt: list[list[int] | None] = [None] * batch_size
        self.kept: list[tuple[Hashable, list[int]] | None] = [None] * batch_size
        self._slot_of: dict[Hashable, int] = {}
        self.snapshots = 0
        self.stop_list = list(stop_ids)  # the host's copy: reading the device's would wait for it
        # Told where the wall time goes when set (benchmarks/engine_profile.py): span(part, **info)
        # around each piece of device work the host issues, call() as each drain starts.
        self.timer = None
        self._alloc(stop_ids, target.model.dtype)

    @torch.inference_mode()
    def _alloc(self, stop_ids: list[int], dtype: torch.dtype) -> None:
        heads, head_dim = _kv_shape(self.model.config)
        b, dev = self.batch_size, self.device
        # Zeros, not empty: masked columns meet a zero attention weight, and 0 * NaN is NaN.
        shape = (b, heads, self.max_len, head_dim)
        self.cache_k = [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(self.layers)]
        self.cache_v = [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(self.layers)]
        self.tokens = torch.zeros(b, dtype=torch.long, device=dev)  # each slot's next input token
        self.pos = torch.zeros(b, dtype=torch.long, device=dev)  # ... and its position
        self.count = torch.zeros(b, dtype=torch.long, device=dev)  # answer tokens so far
        self.done = torch.ones(b, dtype=torch.bool, device=dev)  # no live answer in the slot
        # Each slot's uniforms (data_gen/sampling.py), one per answer token: the same draws as
        # the hf generator's, so sampled answers match it too.
        self.u = torch.zeros(b, self.max_new, dtype=torch.float64, device=dev)
        # Answers; the extra last column takes the writes of finished slots.
        self.out = torch.zeros(b, self.max_new + 1, dtype=torch.long, device=dev)
        self.stop_ids = torch.tensor(stop_ids, dtype=torch.long, device=dev)
        pin = dev.type == "cuda"
        self._host = [(torch.zeros(3, b, dtype=torch.long, pin_memory=pin),
                       torch.zeros(b, self.max_new + 1, dtype=torch.long, pin_memory=pin)) for _ in range(2)]

    # -- the device step --------------------------------------------------------------

    def _decode(self, width: int) -> None:
        """One decode step of every slot, in place, without a host sync."""
        self._choose(self._logits(width))

    def _decode_compiled(self, width: int) -> None:
        """`_decode` of the compiled parts (backend.compile)."""
        logits, choose = self._compiled
        choose(logits(width))

    def _logits(self, width: int) -> torch.Tensor:
        """The step's forward: each slot's next-token logits (B, V), its keys/values written."""
        live = ~self.done
        masks = {}
        if self.attention == "flex":  # each window's mask built before the layers, which all read it
            heads, kv_heads = self.model.config.num_attention_heads, _kv_shape(self.model.config)[0]
            masks = {w: block_mask(self.pos, live, self.max_len, heads // kv_heads, w) for w in self._windows}
        step = _Step(self.cache_k, self.cache_v, pos=self.pos, live=live, width=width, attention=self.attention,
                     masks=masks)
        return self.model(input_ids=self.tokens[:, None], position_ids=self.pos[:, None], use_cache=False,
                          **{STEP_KWARG: step}).logits[:, -1]

    def _choose(self, logits: torch.Tensor) -> None:
        """The step's token choice and bookkeeping, from its logits (B, V)."""
        s = self.sampling
        if s.greedy:
            nxt = logits.argmax(-1)
        else:
            u = self.u.gather(1, self.count.clamp(max=self.max_new - 1)[:, None])[:, 0]
            nxt = sample_tokens(logits, u, s.temperature, s.top_p, s.top_k)
        live = ~self.done
        column = torch.where(live, self.count, self.max_new)
        self.out[torch.arange(self.batch_size, device=self.device), column] = nxt
        self.count += live
        # Not torch.isin: its sorting path syncs with the host (unique), which a graph cannot hold.
        ended = (nxt[:, None] == self.stop_ids).any(-1) | (self.count >= self.max_new)
        self.done |= live & ended
        self.pos += live & ~ended  # a finished row never writes past its last token
        self.tokens.copy_(nxt)

    def _capture(self, run, warmups: int, mid_run: bool = False) -> torch.cuda.CUDAGraph:
        """`run` (device work without a host sync) as a CUDA graph, after `warmups` runs on a
        side stream (cuBLAS handles and the allocator's blocks, before capture). The warm-ups
        must change nothing that the rows will read: a decode step is captured while every slot
        is idle, a prefill forward writes what its replay writes again. Every graph allocates
        from one pool: they replay one at a time, and none's output outlives its replay.
        `mid_run` (a prefill shape's capture, behind queued decode steps): captured on the
        engine's capture stream without torch.cuda.graph's preamble, which waits for the device
        and empties the device and pinned host caches (for memory; here the next forwards would
        allocate all of it again). Capturing runs nothing, and the replay is queued behind what
        was queued before, so no wait is needed."""
        if self._streams is None:  # one warm-up and one capture stream an engine (cuBLAS keeps a workspace a stream)
            self._streams = torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)
        side, capture = self._streams
        current = torch.cuda.current_stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(warmups):
                run()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if mid_run:
            with torch.cuda.stream(capture):
                graph.capture_begin(*(() if self._pool is None else (self._pool,)), capture_error_mode="thread_local")
                try:
                    run()
                finally:
                    graph.capture_end()
        else:  # on the engine's own capture stream: torch.cuda.graph's default one is the current device's
            with torch.cuda.graph(graph, pool=self._pool, stream=capture):
                run()
        self._pool = graph.pool()
        return graph

    def _capture_all(self) -> None:
        widths = [self.max_len]  # flex: every row reads its own blocks of the whole row
        if self.attention == "sdpa":
            widths = sorted({min(w, self.max_len) for w in range(WIDTH_STEP, self.max_len + WIDTH_STEP, WIDTH_STEP)})
        for width in widths:
            try:
                self.graphs[width] = self._capture(functools.partial(self._step, width), warmups=2)
            except Exception as e:  # a target whose decode step does not compile decodes eagerly
                if self._step == self._decode:
                    raise
                warnings.warn(f"the engine's decode step did not compile ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}); it runs eagerly (backend.compile=false "
                              "says so up front)", stacklevel=2)
                self._step = self._decode
                for layer, forward in self._eager_layers:
                    layer.forward = forward
                self.graphs[width] = self._capture(functools.partial(self._step, width), warmups=2)

    def _run_steps(self, width: int, steps: int) -> None:
        if self.graphs is None:
            for _ in range(steps):
                self._step(width)
            return
        graph = self.graphs[width]
        for _ in range(steps):
            graph.replay()

    # -- prompts in, answers out ------------------------------------------------------

    def check(self, key: Hashable, prompt: list[int]) -> None:
        """Raise ValueError if the prompt does not fit a cache row with its answer."""
        if not prompt or len(prompt) + self.max_new > self.max_len:
            raise ValueError(f"prompt {key!r} of {len(prompt)} tokens: the engine holds 1 to "
                             f"{self.max_len - self.max_new} prompt tokens (max_len={self.max_len}, "
                             f"max_new_tokens={self.max_new})")

    def submit(self, key: Hashable, prompt: list[int], seed: int = 0) -> None:
        """Queue a prompt; its answer comes out of `drain` under `key`."""
        self.check(key, prompt)
        self.queue.append((key, list(prompt), seed))

    def _to_device(self, values) -> torch.Tensor:
        """A host list on the device without waiting for the queued steps: a pageable copy
        would block the host until the device drains, a pinned one is queued behind them."""
        t = torch.tensor(values)
        return t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else t

    def _prefill(self, admitted: list[tuple[int, list[int]]], kept: dict[int, int]) -> None:
        """Keys/values of every prompt token but the last into the admitted slots; a slot in
        `kept` (slot -> tokens its row holds already) gets those after them."""
        after = [(slot, p[:-1], kept[slot]) for slot, p in admitted if slot in kept]
        if after and self.prefill == "packed":
            self._prefill_after_packed(after)
        elif after:
            self._prefill_after(after)
        fresh = [(slot, p[:-1]) for slot, p in admitted if slot not in kept]
        if self.prefill == "packed":
            for length, group in packed_groups(fresh, self.shapes):
                self._forward("prefill", ("packed", 1, length), pack_fresh(group, length, self.max_len),
                              self._packed_forward, sum(len(t) for _, t in group))
            return
        for rows, width, group in prefill_groups(fresh, self.shapes):
            # Right padding: a causal row never sees the padding after it.
            packed = [t + [0] * (width - len(t)) + [slot] for slot, t in group]
            self._forward("prefill", ("fresh", rows, width), pad_rows(packed, rows), self._fresh_forward,
                          sum(len(t) for _, t in group))

    def _fresh_forward(self, packed: torch.Tensor) -> None:
        """One prefill forward of fresh rows, `packed` (rows, width + 1): the tokens, then the slot."""
        rows, width = packed.shape[0], packed.shape[1] - 1
        step = _Step(self.cache_k, self.cache_v, rows=packed[:, width])
        positions = torch.arange(width, device=self.device).expand(rows, width)
        self.model(input_ids=packed[:, :width], position_ids=positions, use_cache=False, logits_to_keep=1,
                   **{STEP_KWARG: step})

    def _packed_forward(self, packed: torch.Tensor) -> None:
        """One prefill forward of fresh prompts packed in one row, `packed` (5, T) (pack_fresh): the
        tokens, their positions, slots, cache columns, and where their prompts start in the row."""
        tokens, positions, slots, columns, starts = packed
        length = len(tokens)
        # the prompts a forward of this length holds at most, and the padding (Shapes.prompts)
        bounds = packed_bounds(starts, self.shapes.prompts(length, FRESH_PROMPT_TOKENS) + 1)
        step = _Step(self.cache_k, self.cache_v, packed=(slots, columns, starts, bounds, self.shapes.longest(length)),
                     masks={})
        self.model(input_ids=tokens[None], position_ids=positions[None], use_cache=False, logits_to_keep=1,
                   **{STEP_KWARG: step})

    def _prefill_after_packed(self, todo: list[tuple[int, list[int], int]]) -> None:
        """Prefill of next turns (slot, tokens, start), packed: each row's new tokens end to end
        in one row, each attending to its own cache row (_packed_kept_forward)."""
        for q_len, k_len, group in packed_kept_groups(todo, self.shapes, PACKED_KEYS,
                                                       None if self._flash else PACKED_DENSE_PAIRS):
            flat = pack_kept(group, q_len, k_len, self.max_len)
            self._forward("prefill-kept", ("packed-kept", 1, q_len, k_len), flat,
                          functools.partial(self._packed_kept_forward, q_len=q_len, k_len=k_len),
                          sum(len(t) - start for _, t, start in group))

    def _packed_kept_forward(self, flat: torch.Tensor, q_len: int, k_len: int) -> None:
        """One prefill forward of next turns packed in one row, `flat` (pack_kept): the new
        tokens, their positions, slots and conversations (q_len each), then the keys' slots,
        columns and conversations (k_len each)."""
        q, k = flat[:4 * q_len].view(4, q_len), flat[4 * q_len:].view(3, k_len)
        tokens, positions, slots, seq = q
        # the conversations a forward of this length holds at most, and the padding: once a
        # forward, as _packed_forward's
        sequences = self.shapes.prompts(q_len, KEPT_TURN_TOKENS) + 1
        bounds = sequence_bounds(seq, sequences), sequence_bounds(k[2], sequences), self.shapes.longest(q_len)
        step = _Step(self.cache_k, self.cache_v, kept_packed=(slots, positions, seq, k[0], k[1], k[2], bounds),
                     masks={})
        self.model(input_ids=tokens[None], position_ids=positions[None], use_cache=False, logits_to_keep=1,
                   **{STEP_KWARG: step})

    def _prefill_after(self, todo: list[tuple[int, list[int], int]]) -> None:
        """Prefill of (slot, tokens, start): the row holds tokens[:start] already."""
        for rows, width, span, group in kept_groups(todo, self.shapes):
            packed = [t[start:] + [0] * (width - len(t) + start) + [slot, start, len(t) - start]
                      for slot, t, start in group]
            self._forward("prefill-kept", ("kept", rows, width, span), pad_rows(packed, rows),
                          functools.partial(self._kept_forward, span=span), sum(len(t) - start for _, t, start in group))

    def _kept_forward(self, packed: torch.Tensor, span: int) -> None:
        """One prefill forward after kept prefixes, `packed` (rows, width + 3): the new tokens,
        then the slot, the tokens its row holds and the new tokens' count; `span` cache columns
        read (see _after_prefix)."""
        columns = self.cache_k[0].shape[2]
        width = packed.shape[1] - 3
        rows, starts, new = packed[:, width], packed[:, width + 1], packed[:, width + 2]
        t = torch.arange(width, device=self.device)
        positions = starts[:, None] + t  # (n, T)
        # A padding token writes into the row's last column (see _after_prefix).
        write = (rows[:, None], slice(None), torch.where(t < new[:, None], positions, columns - 1))
        step = _Step(self.cache_k, self.cache_v, rows=rows, fed=positions, write=write, span=span, masks={})
        self.model(input_ids=packed[:, :width], position_ids=positions, use_cache=False, logits_to_keep=1,
                   **{STEP_KWARG: step})

    def _forward(self, part: str, shape: tuple, packed: list[list[int]], forward, tokens: int) -> None:
        """`forward` of the rows `packed` (one host-to-device copy), timed as `part` (`tokens`
        fed): eager off CUDA graphs; with them, eager the first time a shape comes (its warm-up),
        captured the second, replayed from then on, the first two timed as "prefill-first"
        (once a shape a process; a capture waits for the device). A prefill forward is
        idempotent (it writes the keys/values of the tokens it feeds, and reads only what it
        wrote or the rows held before), so the capture's warm-up may run it again."""
        graph = None if self.graphs is None else self.prefill_graphs.get(shape)
        with self._span(part if self.graphs is None or graph is not None else "prefill-first", tokens=tokens,
                        fed=shape[1] * shape[2]):
            buffer = self._to_device(packed)
            if graph is not None:
                graph, static = graph
                static.copy_(buffer)
                graph.replay()
                self.prefill_counts["replayed"] += 1
            elif self.graphs is None:
                forward(buffer)
            elif shape not in self._prefill_seen:
                self._prefill_seen.add(shape)
                forward(buffer)
                self.prefill_counts["eager"] += 1
            else:
                graph = self._capture(lambda: forward(buffer), warmups=1, mid_run=True)
                self.prefill_graphs[shape] = graph, buffer
                graph.replay()
                self.prefill_counts["captured"] += 1

    def _admit(self, deadline: float | None) -> None:
        """Queued prompts into the free slots (prefill and slot state, queued on the device);
        none once ``deadline`` has passed. A conversation's next turn takes the slot of its
        last answer when that is free, and prefills after the tokens the row holds."""
        if past(deadline):
            return
        free = [slot for slot, key in enumerate(self.slot_key) if key is None]
        todo = [self.queue.popleft() for _ in range(min(len(free), len(self.queue)))]
        # A key's kept slot is free: only an admission takes a slot, and it forgets what was kept.
        slots = [self._slot_of.pop(key, None) for key, _, _ in todo]
        # new conversations take the slots no earlier turn is kept in first
        others = iter(sorted(set(free) - set(slots), key=lambda slot: (self.kept[slot] is not None, slot)))
        admitted, kept = [], {}
        for (key, prompt, seed), slot in zip(todo, slots):
            if slot is None:
                slot = next(others)
            elif (shared := shared_prefix(self.kept[slot][1], prompt[:-1])) > 0:
                kept[slot] = shared
            if self.kept[slot] is not None:
                self._slot_of.pop(self.kept[slot][0], None)
                self.kept[slot] = None
            self.slot_key[slot], self.slot_prompt[slot] = key, prompt
            # The first snapshot that shows this prompt in the slot is the next one taken.
            self.slot_pos[slot], self.slot_since[slot] = len(prompt) - 1, self.snapshots
            admitted.append((slot, prompt, seed))
        if not admitted:
            return
        self._prefill([(slot, p) for slot, p, _ in admitted], kept)
        with self._span("copies"):
            self._start_slots(admitted)

    def _start_slots(self, admitted: list[tuple[int, list[int], int]]) -> None:
        """The admitted slots' state on the device: next token, position, uniforms, counts."""
        slots = self._to_device([a[0] for a in admitted])
        self.tokens[slots] = self._to_device([p[-1] for _, p, _ in admitted])
        self.pos[slots] = self._to_device([len(p) - 1 for _, p, _ in admitted])
        if not self.sampling.greedy:
            u = uniform_stream([s for _, _, s in admitted], self.max_new)
            self.u[slots] = u.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else u
        self.count[slots] = 0
        self.done[slots] = False

    def _span(self, part: str, **info):
        """The timer's span around device work the host issues (nothing without a timer)."""
        return contextlib.nullcontext() if self.timer is None else self.timer.span(part, **info)

    def _width(self) -> int:
        """The attention width for the next chunk of steps: the host's positions are one
        chunk old, and the chunk adds its own steps."""
        if self.attention == "flex":  # each row reads its own blocks of the whole row
            return self.max_len
        busy = [p for p, key in zip(self.slot_pos, self.slot_key) if key is not None]
        needed = max(busy) + 2 * self.sync_steps + 1
        if self.graphs is None:  # eager: any width, no graph per width to bound
            return min(self.max_len, needed)
        return min(self.max_len, WIDTH_STEP * math.ceil(needed / WIDTH_STEP))

    def _snapshot(self) -> tuple:
        """Queue a copy of the slots' state and answers to the host (two alternating pinned
        buffers: one is written while the host reads the other)."""
        index = self.snapshots
        self.snapshots += 1
        flags, out = self._host[index % 2]
        flags.copy_(torch.stack([self.done.long(), self.count, self.pos]), non_blocking=True)
        out.copy_(self.out, non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return index, event, flags, out

    def _harvest(self, snapshot: tuple, stop_ids: set[int]) -> Iterator[tuple[Hashable, Completion]]:
        index, event, flags, out = snapshot
        if event is not None:
            event.synchronize()
        done, count, pos = flags.tolist()
        for slot, key in enumerate(self.slot_key):
            if key is None or self.slot_since[slot] > index:  # admitted after this snapshot
                continue
            self.slot_pos[slot] = pos[slot]
            if done[slot]:
                ids = out[slot, :count[slot]].tolist()
                self.slot_key[slot] = None
                # The row holds the prompt and the answer but its last token (never fed) and
                # the one before (an ended row goes on writing at its last position).
                held = self.slot_prompt[slot] + ids
                self.kept[slot] = (key, held[:len(held) - 2])
                self._slot_of[key] = slot
                yield key, Completion(ids, "stop" if ids[-1] in stop_ids else "length")

    @torch.inference_mode()
    def drain(self, deadline: float | None = None) -> Iterator[tuple[Hashable, Completion]]:
        """Generate until the queue and the slots are empty, yielding answers as they end;
        after ``deadline`` (time.monotonic()) until the slots are: the prompts still queued
        stay in the queue."""
        # The engine's GPU is current while it runs (graphs replay on the current device's
        # stream; under torchrun nothing else makes the rank's GPU current).
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            if self.graphs == {}:
                self._capture_all()
            if self.timer is not None:
                self.timer.call()
            yield from self._loop(deadline)

    def _loop(self, deadline: float | None) -> Iterator[tuple[Hashable, Completion]]:
        """Each round queues a chunk of steps and a snapshot after it, then reads the previous
        round's snapshot while the device runs the new chunk, and refills the slots it shows
        free (their prefill queued behind the chunk). The host's work hides behind the
        device's; a finished row idles one to two chunks before its slot takes a new prompt.
        Off CUDA each round reads its own snapshot (chunks of one step)."""
        stop_ids = set(self.stop_list)
        pending = None
        while True:
            snapshot = None
            if any(key is not None for key in self.slot_key):
                width = self._width()
                with self._span("decode", width=width):
                    self._run_steps(width, self.sync_steps)
                with self._span("copies"):
                    snapshot = self._snapshot()
            if self.device.type != "cuda":  # nothing runs ahead of the host: read it now
                pending, snapshot = snapshot, None
            if pending is not None:
                yield from self._harvest(pending, stop_ids)
            self._admit(deadline)
            if snapshot is None and all(key is None for key in self.slot_key):
                return
            pending = snapshot


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class EngineGenerator:
    """The `engine` backend.kind: the pipeline's Generator interface over a GenerationEngine
    (`generate`, a call drained to its last answer), and the streamed one the turn scheduler
    uses (data_gen/turns.py): `wanted` turns are `submit`ted as slots free, `drain` yields
    answers as they end while more are submitted, `unstarted` gives back what the deadline
    kept queued."""

    streams = True

    def __init__(self, target: TargetModel, cfg: BackendConfig, sampling: SamplingConfig, stop_ids: list[int],
                 max_prompt_len: int, buckets: bool | None = None):
        if target.device.type == "cpu" and cfg.cpu_threads is not None:
            torch.set_num_threads(cfg.cpu_threads)
        self.target = target  # shared with a generator of other sampling settings (magpie)
        self.engine = GenerationEngine(target, cfg.batch_size, max_prompt_len + sampling.max_new_tokens, sampling,
                                       stop_ids, cfg.cuda_graphs, sync_steps=cfg.sync_steps, attention=cfg.attention,
                                       buckets=buckets, compile=cfg.compile, prefill=cfg.prefill,
                                       compile_region=cfg.compile_region)

    @classmethod
    def load(cls, spec: str, cfg: BackendConfig, sampling: SamplingConfig, stop_ids: list[int],
             max_prompt_len: int, local_rank: int = 0, dtype: str = "auto",
             cache_dir: str | None = None) -> "EngineGenerator":
        from data_gen.hf_generator import rank_device
        from dflash_train.model.target import load_target

        device = rank_device(cfg.device, local_rank)
        return cls(load_target(spec, dtype=dtype, device=device, cache_dir=cache_dir), cfg, sampling, stop_ids,
                   max_prompt_len)

    def generate(self, prompts: list[list[int]], seeds: list[int], deadline: float | None = None,
                 progress: Progress | None = None) -> list[Completion | None]:
        for i, p in enumerate(prompts):  # all of them before any is queued
            self.engine.check(i, p)
        # Longest first, as the hf generator: long prompts start early, and the prefill
        # groups of similar lengths.
        for i in sorted(range(len(prompts)), key=lambda i: -len(prompts[i])):
            self.engine.submit(i, prompts[i], seeds[i])
        results: list[Completion | None] = [None] * len(prompts)
        for i, completion in self.engine.drain(deadline):
            results[i] = completion
            if progress is not None:
                progress(1, len(completion.ids))
        self.engine.queue.clear()  # what the deadline left unstarted stays None
        return results

    def wanted(self) -> int:
        """How many more prompts the engine's next admission takes: its free slots less the
        prompts already queued (a slot frees as its answer is handed over)."""
        return max(0, self.engine.slot_key.count(None) - len(self.engine.queue))

    def submit(self, key: Hashable, prompt: list[int], seed: int) -> None:
        self.engine.submit(key, prompt, seed)

    def drain(self, deadline: float | None = None) -> Iterator[tuple[Hashable, Completion]]:
        """(key, answer) as answers end, until the queue and the slots are empty (after
        ``deadline``, until the slots are)."""
        return self.engine.drain(deadline)

    def unstarted(self) -> list[Hashable]:
        """The keys still queued (the deadline kept them from starting), out of the queue."""
        keys = [key for key, _, _ in self.engine.queue]
        self.engine.queue.clear()
        return keys
