"""DFlash drafter: one file for training, inference and `trust_remote_code` loading.

This file is copied verbatim beside exported weights as `dflash.py`, so it imports only
torch and transformers and works with transformers 4.57.x and 5.x. It is longer than the
style guide's 800 lines on purpose: the model, its decoding loop and the static (CUDA graph)
runtime are what `trust_remote_code` loads and what the bundled runtime imports, one file
with no second exported module to keep in step.

A DFlash drafter is a stack of Qwen3-style decoder layers whose queries come only from a
block of B tokens `[anchor, MASK, ..., MASK]`; every layer's keys and values are
`[projected target context features | block tokens]`. It has no embedding and no LM head:
the target's frozen embedding embeds the block and the target's LM head reads the output.

Shape legend:
  b  batch            Q  query (block) tokens: B at inference, N*B when training
  C  context tokens   H  hidden size           n  number of target features
  h  attention heads  g  key/value heads       d  head dim
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config
from transformers.cache_utils import Cache, CacheLayerMixin

# hidden_states[0] of an HF causal LM is the embedding output: id i is hidden_states[i + 1].
EMBEDDING_OFFSET = 1
# The paper's block: an anchor and 15 masked slots. Configs that name no block size get it.
# dflash_train.contract.DEFAULT_BLOCK_SIZE is the framework's home for it (recipes read it
# there); this file imports nothing of ours, being copied beside every export, so it keeps
# this copy, held equal to the contract's by tests/unit/test_layout.py. Code outside this
# file reads a config's block size through `block_size_of`, never this constant.
DEFAULT_BLOCK_SIZE = 16
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


def default_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """Evenly spread feature layers, skipping the first and the last three layers."""
    if num_features == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_features - 1)) for i in range(num_features)]


def dflash_field(config, name: str, default=None):
    """A DFlash setting: `dflash_config` wins over a top-level attribute of the same name."""
    nested = getattr(config, "dflash_config", None) or {}
    if name in nested:
        return nested[name]
    return getattr(config, name, default)


def block_size_of(config) -> int:
    """The block size a drafter config means: its DFlash setting, else the default."""
    return int(dflash_field(config, "block_size", DEFAULT_BLOCK_SIZE))


def rope_parameters(config) -> dict:
    """RoPE settings from a 5.x `rope_parameters` or a 4.x `rope_theta`/`rope_scaling` config."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return dict(params)
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    return params


class DFlashConfig(Qwen3Config):
    """Qwen3Config plus the DFlash fields; serialises to the contract's `config.json`."""

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, num_target_layers: int | None = None, dflash_config=None, **kwargs):
        super().__init__(**kwargs)
        self.block_size = block_size
        self.num_target_layers = num_target_layers
        self.dflash_config = dict(dflash_config or {})
        self.architectures = ["DFlashDraftModel"]
        self.auto_map = {"AutoModel": "dflash.DFlashDraftModel"}
        self.tie_word_embeddings = False

    @classmethod
    def from_target(
        cls,
        target_config,
        *,
        mask_token_id: int,
        num_hidden_layers: int = 5,
        block_size: int = DEFAULT_BLOCK_SIZE,
        target_layer_ids: list[int] | None = None,
        num_features: int | None = None,
        **overrides,
    ) -> "DFlashConfig":
        """A drafter config for a target: attention geometry and RoPE follow the target."""
        t = target_config
        num_target_layers = t.num_hidden_layers
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(num_target_layers, num_features or num_hidden_layers)
        heads = t.num_attention_heads
        rope = rope_parameters(t)
        fields = dict(
            hidden_size=t.hidden_size,
            intermediate_size=t.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(t, "num_key_value_heads", None) or heads,
            head_dim=getattr(t, "head_dim", None) or t.hidden_size // heads,
            rms_norm_eps=getattr(t, "rms_norm_eps", 1e-6),
            max_position_embeddings=getattr(t, "max_position_embeddings", 32768),
            vocab_size=t.vocab_size,
            num_hidden_layers=num_hidden_layers,
            attention_bias=False,
            hidden_act="silu",
            rope_theta=rope["rope_theta"],
            rope_scaling=None if rope.get("rope_type", "default") == "default" else rope,
            rope_parameters=rope,
        )
        fields.update(overrides)
        return cls(
            block_size=block_size,
            num_target_layers=num_target_layers,
            dflash_config={"mask_token_id": int(mask_token_id), "target_layer_ids": [int(i) for i in target_layer_ids]},
            **fields,
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 like the Qwen3/Llama targets do, then cast back.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables computed on the fly: no buffers, so meta-device loading cannot lose them."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self._cache: dict = {}

    def _inv_freq(self, device) -> tuple[torch.Tensor, float]:
        if device not in self._cache:
            params = rope_parameters(self.config)
            if params.get("rope_type", "default") == "default":
                exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
                inv_freq, scale = 1.0 / (params["rope_theta"] ** exponent), 1.0
            else:
                from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

                inv_freq, scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](self.config, device)
            self._cache[device] = (inv_freq.float(), float(scale))
        return self._cache[device]

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq, scale = self._inv_freq(position_ids.device)
        freqs = position_ids[..., None].float() * inv_freq  # (b, L, d/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (b, L, d)
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (b, heads, L, d); cos/sin: (b, L, d)."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def visible_mask(anchors, context_len, block_size, doc_ids=None, sliding_window=None, causal_block=False):
    """Dense visibility of the concatenated training layout: (b, 1, N*B, C + N*B) bool.

    anchors: (b, N) anchor index of each block in the context row. A block query sees
    context strictly before its anchor (at inference the anchor's own features do not
    exist yet; seeing them leaks the answer), in the anchor's document when rows are
    packed, plus its own block: all slots, or causally for sliding layers. Sliding layers
    also see at most `sliding_window` positions back.
    """
    b, n = anchors.shape
    dev = anchors.device
    slot = torch.arange(block_size, device=dev)
    q_anchor = anchors.repeat_interleave(block_size, dim=1)  # (b, Q)
    q_block = torch.arange(n, device=dev).repeat_interleave(block_size)  # (Q,)
    q_slot = slot.repeat(n)  # (Q,)
    q_pos = q_anchor + q_slot  # (b, Q) index the slot stands for
    ctx = torch.arange(context_len, device=dev)
    see_ctx = ctx[None, None, :] < q_anchor[:, :, None]  # (b, Q, C)
    if doc_ids is not None:
        anchor_doc = doc_ids.gather(1, anchors.clamp(max=context_len - 1))  # (b, N)
        q_doc = anchor_doc.repeat_interleave(block_size, dim=1)
        see_ctx = see_ctx & (doc_ids[:, None, :] == q_doc[:, :, None])
    same_block = q_block[:, None] == q_block[None, :]  # (Q, Q)
    if causal_block:
        same_block = same_block & (q_slot[None, :] <= q_slot[:, None])
    see_block = same_block[None].expand(b, -1, -1)
    if sliding_window is not None:
        see_ctx = see_ctx & (q_pos[:, :, None] - ctx[None, None, :] < sliding_window)
        see_block = see_block & (q_slot[:, None] - q_slot[None, :] < sliding_window)[None]
    return torch.cat([see_ctx, see_block], dim=-1)[:, None]


@dataclass
class ContextCache:
    """Per-layer K/V of the context features only; block K/V are never cached."""

    keys: list = field(default_factory=list)
    values: list = field(default_factory=list)

    def read_and_append(self, layer: int, k_ctx: torch.Tensor, v_ctx: torch.Tensor):
        """Store new context K/V for `layer`; return all context K/V: (b, g, C, d)."""
        if layer == len(self.keys):
            self.keys.append(k_ctx)
            self.values.append(v_ctx)
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k_ctx], dim=-2)
            self.values[layer] = torch.cat([self.values[layer], v_ctx], dim=-2)
        return self.keys[layer], self.values[layer]


class Attention(nn.Module):
    flex_kernel_options: dict | None = None  # flex_attention's kernel_options (the trainer's backend choice)

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        bias = getattr(config, "attention_bias", False)
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        layer_types = getattr(config, "layer_types", None) or [FULL_ATTENTION] * config.num_hidden_layers
        self.layer_type = layer_types[layer_idx]
        self.sliding_window = config.sliding_window if self.layer_type == SLIDING_ATTENTION else None

    def _heads(self, x: torch.Tensor, proj: nn.Linear, norm: RMSNorm | None, heads: int) -> torch.Tensor:
        y = proj(x).view(*x.shape[:2], heads, self.head_dim)  # (b, L, heads, d)
        if norm is not None:
            y = norm(y)
        return y.transpose(1, 2)  # (b, heads, L, d)

    def forward(self, x, ctx, cos, sin, mask, cache: ContextCache | None):
        """x: (b, Q, H) block; ctx: (b, C, H) fused context; cos/sin: (b, C + Q, d)."""
        c = ctx.shape[1]
        q = apply_rope(self._heads(x, self.q_proj, self.q_norm, self.num_heads), cos[:, c:], sin[:, c:])
        k_ctx = apply_rope(self._heads(ctx, self.k_proj, self.k_norm, self.num_kv_heads), cos[:, :c], sin[:, :c])
        k_blk = apply_rope(self._heads(x, self.k_proj, self.k_norm, self.num_kv_heads), cos[:, c:], sin[:, c:])
        v_ctx = self._heads(ctx, self.v_proj, None, self.num_kv_heads)
        v_blk = self._heads(x, self.v_proj, None, self.num_kv_heads)
        if cache is not None:
            k_ctx, v_ctx = cache.read_and_append(self.layer_idx, k_ctx, v_ctx)
        k = torch.cat([k_ctx, k_blk], dim=2)  # (b, g, C + Q, d)
        v = torch.cat([v_ctx, v_blk], dim=2)
        if isinstance(mask, dict):
            mask = mask[self.layer_type]
        if mask is not None and not isinstance(mask, torch.Tensor):  # a flex-attention BlockMask
            from torch.nn.attention.flex_attention import flex_attention

            out = flex_attention(q, k, v, block_mask=mask, scale=self.scaling, enable_gqa=True,
                                 kernel_options=self.flex_kernel_options)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], -1))  # (b, Q, H)


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, ctx, cos, sin, mask, cache):
        x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(PreTrainedModel):
    config_class = DFlashConfig
    base_model_prefix = ""
    _no_split_modules = ["DecoderLayer"]

    def __init__(self, config):
        super().__init__(config)
        self.target_layer_ids = [int(i) for i in dflash_field(config, "target_layer_ids")]
        self.mask_token_id = dflash_field(config, "mask_token_id")
        self.block_size = block_size_of(config)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        self.activation_checkpointing = False
        self.post_init()

    def _init_weights(self, module):
        std = getattr(self.config, "initializer_range", 0.02)
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)

    @property
    def layer_types(self) -> list[str]:
        return [layer.self_attn.layer_type for layer in self.layers]

    def forward(
        self,
        noise_embedding: torch.Tensor,
        target_hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask=None,
        past_key_values: ContextCache | None = None,
        use_cache: bool = False,
        **kwargs,
    ) -> torch.Tensor:
        """Drafter hidden states after the final norm: (b, Q, H).

        noise_embedding: (b, Q, H) target-embedded block tokens. target_hidden: (b, C, n*H)
        raw concatenated target features (new ones only when a cache is given).
        position_ids: (b, C + Q), context positions then block positions. attention_mask:
        None (everything visible), a dense bool / flex BlockMask, or a dict of them keyed
        by layer type.
        """
        ctx = self.hidden_norm(self.fc(target_hidden))  # (b, C, H)
        cos, sin = self.rotary_emb(position_ids, noise_embedding.dtype)  # (b, C + Q, d)
        cache = past_key_values if use_cache else None
        x = noise_embedding
        for layer in self.layers:
            if self.activation_checkpointing and self.training:
                x = torch.utils.checkpoint.checkpoint(layer, x, ctx, cos, sin, attention_mask, None, use_reentrant=False)
            else:
                x = layer(x, ctx, cos, sin, attention_mask, cache)
        return self.norm(x)

    def inference_masks(self, start: int, width: int, device) -> dict | None:
        """Masks for one block at `start` over a context cache of positions 0..start-1."""
        if SLIDING_ATTENTION not in self.layer_types:
            return None  # full-attention layers see the whole context and the whole block
        anchors = torch.tensor([[start]], device=device)
        sliding = visible_mask(anchors, start, width, sliding_window=self.config.sliding_window, causal_block=True)
        return {FULL_ATTENTION: None, SLIDING_ATTENTION: sliding}

    @torch.inference_mode()
    def draft(self, target, block_ids, new_features, start: int, cache: ContextCache) -> torch.Tensor:
        """One denoising step: logits for slots 1..L-1 of the block at `start`: (1, L-1, V)."""
        width = block_ids.shape[1]
        c = new_features.shape[1]
        positions = torch.arange(start - c, start + width, device=block_ids.device)[None]
        noise = target.get_input_embeddings()(block_ids)
        hidden = self(noise, new_features, positions, self.inference_masks(start, width, block_ids.device), cache, True)
        return target.get_output_embeddings()(hidden[:, 1:])

    def spec_generate(
        self,
        target,
        input_ids: torch.LongTensor,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop_token_ids=None,
        mask_token_id: int | None = None,
        return_stats: bool = False,
        generator: torch.Generator | None = None,
        time_steps: bool = False,
        static: bool | None = None,
    ):
        """Speculative decoding with `target` (an HF causal LM); batch size 1. See `speculate`.

        time_steps: fill `SpecOutput.step_times` (draft, verify, bookkeeping seconds); on a
        GPU this synchronises the device at every boundary, so leave it off when only
        throughput matters.
        static: the fixed-shape runtime (`speculate_static`: preallocated caches, each step a
        CUDA graph on a GPU) or, False, the growing-cache one (`speculate`). None picks
        static on a GPU when the target allows it (`static_unsupported`).
        """
        self.eval()
        static = use_static(static, target, input_ids.device)
        run = speculate_static if static else speculate
        result = run(
            self, target, input_ids, max_new_tokens, Sampling(temperature, top_p, top_k),
            stop_token_ids, mask_token_id, generator, StepClock(input_ids.device) if time_steps else NO_CLOCK,
        )
        return result if return_stats else result.output_ids


def check_sampling(temperature: float, top_p: float = 1.0, top_k: int = 0, prefix: str = "") -> None:
    """The one check of sampling settings (this runtime's, dflash-eval's, data generation's):
    ValueError naming the offending value, ``prefix`` its recipe section ("sampling.")."""
    if temperature < 0:
        raise ValueError(f"{prefix}temperature={temperature}: must be >= 0 (0 is greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"{prefix}top_p={top_p}: must be in (0, 1]")
    if top_k < 0:
        raise ValueError(f"{prefix}top_k={top_k}: must be >= 0 (0 disables it)")


@dataclass
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        check_sampling(self.temperature, self.top_p, self.top_k)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution actually sampled from: temperature, then top-k, then top-p."""
        scores = logits.float() / self.temperature
        if 0 < self.top_k < scores.shape[-1]:
            kth = torch.topk(scores, self.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if self.top_p < 1:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= self.top_p
            probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
            probs = probs / probs.sum(-1, keepdim=True)
        return probs


@dataclass
class SpecOutput:
    output_ids: torch.LongTensor  # (1, prompt + new)
    acceptance_lengths: list  # per verify step: accepted drafts + 1 (tokens committed)
    num_new_tokens: int
    prefill_s: float
    decode_s: float
    step_times: dict | None = None  # seconds per part of the decode steps, when timed (StepClock)

    @classmethod
    def of_run(cls, tokens: list, lengths: list, prompt_len: int, times: tuple, clock, device) -> "SpecOutput":
        """One batch-1 run: ``tokens`` prompt included; ``times`` (start, prefill done, decode done)."""
        t0, t1, t2 = times
        return cls(output_ids=torch.tensor([tokens], dtype=torch.long, device=device), acceptance_lengths=lengths,
                   num_new_tokens=len(tokens) - prompt_len, prefill_s=t1 - t0, decode_s=t2 - t1,
                   step_times=clock.result())


def target_features(hidden_states, layer_ids) -> torch.Tensor:
    """(b, T, n*H) the target's features: decoder layer outputs ``layer_ids`` side by side.
    ``hidden_states`` is HF's tuple or anything indexed the same way (layer i at i + 1)."""
    return torch.cat([hidden_states[i + EMBEDDING_OFFSET] for i in layer_ids], dim=-1)


def device_clock(device) -> float:
    """time.perf_counter() once the device has run everything queued on it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


STEP_PARTS = ("draft", "verify", "bookkeeping")
# The static runtime's finer laps (eval/breakdown.py reads them) and the part each counts in here.
FINE_PARTS = {"accept": "verify", "host": "bookkeeping"}


class StepClock:
    """Wall time of the parts of the decode steps, summed over steps.

    draft: the block, the drafter forward and the draft tokens; verify: the target's
    forward over the block and the acceptance rule; bookkeeping: committing, stop tokens,
    cache crops and the new context features. Each lap waits for the device's queue.
    """

    def __init__(self, device):
        self.device = device
        self.totals = dict.fromkeys(STEP_PARTS, 0.0)
        self.last = 0.0

    def lap(self, part: str | None = None) -> None:
        now = device_clock(self.device)
        if part is not None:
            self.totals[FINE_PARTS.get(part, part)] += now - self.last
        self.last = now

    def result(self) -> dict:
        return dict(self.totals)


class _NoClock:
    """The untimed path: no device synchronisation at all."""

    def lap(self, part: str | None = None) -> None:
        pass

    def result(self) -> None:
        return None


NO_CLOCK = _NoClock()


def verify_drafts(drafts, draft_probs, target_logits, sampling: Sampling, generator):
    """Accepted draft count and the token that follows them.

    drafts: (L-1,), draft_probs: (L-1, V) or None (greedy), target_logits: (L, V) where row
    i is the target's prediction after the anchor and the first i drafts.
    """
    if sampling.greedy:
        target_tokens = target_logits.argmax(-1)  # (L,)
        agree = (drafts == target_tokens[:-1]).long()
        accepted = int(agree.cumprod(0).sum())
        return accepted, target_tokens[accepted]
    p = sampling.probs(target_logits)  # (L, V)
    for i, token in enumerate(drafts.tolist()):
        ratio = p[i, token] / draft_probs[i, token]
        if torch.rand((), generator=generator, device=p.device) >= ratio:
            # Rejected: resample from the residual max(0, p - q), which keeps the output
            # distribution exactly the target's.
            residual = (p[i] - draft_probs[i]).clamp_min(0)
            residual = residual if residual.sum() > 0 else p[i]
            return i, torch.multinomial(residual / residual.sum(), 1, generator=generator)[0]
    return len(drafts), torch.multinomial(p[-1], 1, generator=generator)[0]


def _crop(cache, keep: int) -> None:
    # A negative crop removes tokens in both transformers 4.57 and 5.x (5.x rejects positive).
    remove = cache.get_seq_length() - keep
    if remove > 0:
        cache.crop(-remove)


def _first_token(logits, sampling: Sampling, generator) -> torch.Tensor:
    if sampling.greedy:
        return logits.argmax(-1)
    return torch.multinomial(sampling.probs(logits), 1, generator=generator)[0]


def _cut_after_stop(committed: list[int], stops: set) -> list[int]:
    for i, tok in enumerate(committed):
        if tok in stops:
            return committed[: i + 1]
    return committed


def _check_request(model, input_ids, mask_token_id) -> int:
    """The mask id to fill blocks with; raises on what the runtimes cannot serve."""
    if input_ids.shape[0] != 1:
        raise ValueError(f"spec_generate supports batch size 1, got input_ids of shape {tuple(input_ids.shape)}")
    mask_id = model.mask_token_id if mask_token_id is None else mask_token_id
    if mask_id is None:
        raise ValueError("no mask_token_id: pass one or set dflash_config.mask_token_id in the drafter config")
    return mask_id


@torch.inference_mode()
def speculate(model, target, input_ids, max_new_tokens, sampling, stop_token_ids, mask_token_id, generator,
              clock=NO_CLOCK):
    """Draft a block with `model`, verify it with `target` in one forward, commit, repeat.

    The drafter's cache holds only context K/V; the target's cache is cropped to the
    committed tokens after every step. Each step's new context features are the target's
    features of the tokens it just committed (the anchor and the accepted drafts).
    """
    from transformers import DynamicCache

    mask_id = _check_request(model, input_ids, mask_token_id)
    stops = set(stop_token_ids or [])
    device = input_ids.device
    prompt_len = input_ids.shape[1]
    t0 = device_clock(device)
    target_cache = DynamicCache()
    out = target(input_ids, past_key_values=target_cache, use_cache=True, output_hidden_states=True)
    tokens = input_ids[0].tolist() + [int(_first_token(out.logits[0, -1], sampling, generator))]
    new_features = target_features(out.hidden_states, model.target_layer_ids)  # (1, prompt, n*H)
    draft_cache = ContextCache()
    t1 = device_clock(device)
    lengths = []
    while len(tokens) - prompt_len < max_new_tokens and tokens[-1] not in stops:
        clock.lap()
        start = len(tokens) - 1  # the anchor: last committed token, not yet seen by the target
        # a block of width L commits at most L tokens (L-1 drafts and the target's next)
        width = min(model.block_size, max_new_tokens - (len(tokens) - prompt_len))
        block = torch.full((1, width), mask_id, dtype=torch.long, device=device)
        block[0, 0] = tokens[-1]
        draft_probs = None
        if width > 1:
            logits = model.draft(target, block, new_features, start, draft_cache)[0]  # (L-1, V)
            if sampling.greedy:
                block[0, 1:] = logits.argmax(-1)
            else:
                draft_probs = sampling.probs(logits)
                block[0, 1:] = torch.multinomial(draft_probs, 1, generator=generator)[:, 0]
        clock.lap("draft")
        positions = torch.arange(start, start + width, device=device)[None]
        out = target(block, position_ids=positions, past_key_values=target_cache, use_cache=True,
                     output_hidden_states=True)
        accepted, bonus = verify_drafts(block[0, 1:], draft_probs, out.logits[0], sampling, generator)
        clock.lap("verify")
        committed = _cut_after_stop(block[0, 1 : accepted + 1].tolist() + [int(bonus)], stops)
        tokens += committed
        lengths.append(len(committed))
        _crop(target_cache, len(tokens) - 1)
        new_features = target_features(out.hidden_states, model.target_layer_ids)[:, : accepted + 1]
        clock.lap("bookkeeping")
    return SpecOutput.of_run(tokens, lengths, prompt_len, (t0, t1, device_clock(device)), clock, device)


# The static runtime. Every decode step has fixed shapes, so on a GPU each step is captured
# once as a CUDA graph and replayed (one launch instead of hundreds of kernels from Python);
# on a CPU the same step functions run eagerly. The target's K/V and the drafter's context
# K/V live in preallocated buffers where slot i holds position i: a step writes its block's
# K/V at the block's positions and masks by position instead of cropping, and the slots
# past the committed tokens (rejected drafts, an earlier request) are hidden until a later
# step overwrites them. Every step input is a fixed tensor filled in place. (It lives in
# this file, past the usual file length, because an exported drafter carries its runtime.)
# The buffers hold `rows` requests side by side, each at its own positions: one row is
# `speculate_static`; several are the evaluation's batched loop (eval/static_batched.py).

MIN_SLOTS = 1024  # cache slots: a power of two, at least this, so few requests rebuild
GRAPH_WARMUP_RUNS = 2  # eager runs on a side stream before capture, as CUDA graphs require
STATIC_ATTENTION = ("sdpa", "eager")  # the implementations that read our 4D additive masks
MAX_STOP_IDS = 8  # stop tokens the greedy device loop checks; more take the per-step loop
# A run of replayed steps is at most this share of what the remaining budget needs at the
# acceptance seen so far: steps past the end cost a whole step each, a host read between runs
# a few microseconds, so runs stay short of the end.
RUN_SHARE = 0.5
RUN_WITH_STOPS = 4  # with stop tokens, runs of at most this many steps (a read costs ~0.03 ms on an H100)


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
                # thread_local: a CUDA call from another thread (a compile worker) does not void the capture
                with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                    self.out = self.fn()
        self.graph.replay()
        return self.out


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
    of `layer_ids`."""

    def __init__(self, target, size: int, width: int, layer_ids=(), graphs: bool = True, rows: int = 1):
        device = target.get_input_embeddings().weight.device
        self.target, self.layer_ids, self.graphs, self.weights = target, list(layer_ids), graphs, _where(target)
        self.cache = SlotCache(target.config.num_hidden_layers, size)
        self.slots = torch.arange(size, device=device)
        self.ids = torch.zeros(rows, width, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, width, dtype=torch.long, device=device)
        self.step = Replayable(lambda: self.forward(self.ids, self.positions), device, graphs)

    def forward(self, ids, positions, logits_to_keep: int = 0):
        """Logits (b, L, V) and features (b, L, n*H) or None; writes K/V at `positions` (b, L)."""
        self.cache.write_at = _slot_index(positions)
        mask = _causal_slot_mask(positions, self.slots, self.target.dtype)
        out = self.target(ids, attention_mask=mask, position_ids=positions, past_key_values=self.cache,
                          use_cache=True, output_hidden_states=bool(self.layer_ids), logits_to_keep=logits_to_keep)
        return out.logits, target_features(out.hidden_states, self.layer_ids) if self.layer_ids else None

    def prefill(self, input_ids, logits_to_keep: int = 0):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        return self.forward(input_ids, positions, logits_to_keep)

    def fits(self, target, size: int, graphs: bool, rows: int = 1) -> bool:
        """Still valid for `target`: the same module, dtype and device (the graphs read its
        weights where they were at capture), enough slots, the same capture choice and rows."""
        return (target is self.target and self.weights == _where(target) and size <= self.cache.size
                and graphs == self.graphs and rows == self.ids.shape[0])


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
    """Per layer type (b, 1, B, S + B) bool: what each block slot sees (`end`: (b, 1)).

    Context slots before the anchor's position hold committed tokens' features. Block slots
    at or past `end` (positions the budget can never commit) are hidden from the others,
    which makes a B-wide block compute what the dynamic runtime's narrowed last block does;
    a slot always sees itself, so no softmax row is empty.
    """
    width = block_pos.shape[1]
    see_ctx = (slots[None, None, :] < block_pos[:, :1, None]).expand(-1, width, -1)  # (b, B, S)
    own = torch.eye(width, dtype=torch.bool, device=slots.device)[None]
    see_block = (block_pos < end)[:, None, :] | own  # (b, B, B)
    masks = {FULL_ATTENTION: torch.cat([see_ctx, see_block.expand(see_ctx.shape[0], -1, -1)], -1)[:, None]}
    if SLIDING_ATTENTION in drafter.layer_types:
        window = drafter.config.sliding_window
        near = block_pos[:, :, None] - slots[None, None, :] < window  # (b, B, S)
        back = own.new_ones(width, width).tril() & ~own.new_ones(width, width).tril(-window)  # (B, B)
        masks[SLIDING_ATTENTION] = torch.cat([see_ctx & near, see_block & back], -1)[:, None]
    return masks


class StaticSpeculator:
    """The static runtime's buffers and replayable steps for one drafter and target.

    The verify step reads the block (b, B) at its positions; the draft step reads the same
    block plus the previous verify's B features (`ctx_feats`, at `ctx_pos`), writes their
    context K/V and drafts. Only what the host decides between steps is filled in place.
    `rows` requests share every step, each at its own positions.
    """

    def __init__(self, drafter, target, size: int, graphs: bool = True, rows: int = 1):
        self.verifier = TargetSlots(target, size, drafter.block_size, drafter.target_layer_ids, graphs, rows)
        device, dtype = self.verifier.slots.device, target.dtype
        self.target, self.drafter, self.weights = target, drafter, _where(drafter)
        self.context = SlotContextCache(size)
        self.offsets = torch.arange(drafter.block_size, device=device)[None]
        self.end = torch.zeros(rows, 1, dtype=torch.long, device=device)  # per row: first position never committed
        self.ctx_feats = torch.zeros(rows, drafter.block_size, drafter.fc.in_features, dtype=dtype, device=device)
        self.ctx_pos = torch.zeros(rows, drafter.block_size, dtype=torch.long, device=device)
        # `drafter.compile_static_draft` (eval's compile_drafter): the fixed-shape draft step
        # compiled by torch.compile inside the captured graphs, fewer and fused kernels; its
        # drafts may differ from eager's by rounding, the committed tokens stay the target's.
        self.compiled = _compiles_draft(drafter, graphs, device)
        compiled = torch.compile(self.draft, dynamic=False) if self.compiled else None

        def draft(feats, ctx_pos):  # `self.draft` looked up at each call, as a step's code always is
            return (compiled or self.draft)(feats, ctx_pos)
        self.draft_step = Replayable(lambda: draft(self.ctx_feats, self.ctx_pos), device, graphs)
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
                    self.ctx_pos, self.block, self.block_pos)
        self.greedy_step = Replayable(lambda: self.advance(lambda: draft(self.ctx_feats, self.ctx_pos)), device,
                                      graphs, state=advanced)

    @property
    def block(self) -> torch.Tensor:
        return self.verifier.ids

    @property
    def block_pos(self) -> torch.Tensor:
        return self.verifier.positions

    def fits(self, drafter, target, size: int, graphs: bool, rows: int = 1) -> bool:
        return (drafter is self.drafter and self.weights == _where(drafter)
                and _compiles_draft(drafter, graphs, self.target.device) == self.compiled
                and self.verifier.fits(target, size, graphs, rows))

    def draft(self, feats, ctx_pos) -> torch.Tensor:
        """Logits for block slots 1..B-1: (b, B-1, V). feats: (b, C, n*H) at ctx_pos (b, C)."""
        self.context.write_at = _slot_index(ctx_pos)
        masks = _slot_draft_masks(self.drafter, self.verifier.slots, self.block_pos, self.end)
        noise = self.target.get_input_embeddings()(self.block)
        hidden = self.drafter(noise, feats, torch.cat([ctx_pos, self.block_pos], 1), masks, self.context, True)
        return self.target.get_output_embeddings()(hidden[:, 1:])

    def set_block(self, anchor: torch.Tensor, start, mask_id: int) -> None:
        """[anchor, MASK, ...] at positions start..start+B-1; anchor: (b,) on the device,
        start: an int (one row) or (b, 1) on the device."""
        self.block.fill_(mask_id)
        self.block[:, :1].copy_(anchor.view(-1, 1))
        torch.add(self.offsets, start, out=self.block_pos)

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

        Draft (``draft()``: logits (b, B-1, V)), verify, accept the prefix of drafts the target
        agrees with within the row's budget, then the target's own token; cut after the first
        stop token. A row's committed tokens go to `tokens` at their positions, their count
        to `counts` at the row's step; the verify's features become the next draft's
        context. A finished row keeps its state (its block is recomputed, nothing recorded),
        so running more steps than needed changes no result.
        """
        width = self.offsets.shape[1]
        slot = self.offsets  # (1, B)
        self.set_block(self.anchor, self.start, self.mask_id)
        self.block[:, 1:] = draft().argmax(-1)
        logits, feats = self.verifier.forward(self.block, self.block_pos)
        best = logits.argmax(-1)  # (b, B): the target's token after each block slot
        usable = (self.end - self.start).clamp(max=width) - 1  # (b, 1) drafts the budget can commit
        count = greedy_accepted(self.block[:, 1:], best, usable)[:, None] + 1  # (b, 1) accepted + the target's token
        stop = (best[..., None] == self.stop_ids).any(-1) & (slot < count)  # (b, B)
        count = torch.minimum(count, torch.where(stop, slot, width).amin(1, keepdim=True) + 1) * ~self.done
        at = (self.start + 1 + slot).clamp(max=self.tokens.shape[1] - 1)  # (b, B) the committed tokens' positions
        self.tokens.scatter_(1, at, torch.where(slot < count, best, self.tokens.gather(1, at)))
        live = ~self.done
        self.counts.scatter_(1, self.steps, torch.where(live, count, self.counts.gather(1, self.steps)))
        self.steps += live
        self.anchor.copy_(torch.where(live[:, 0], best.gather(1, (count - 1).clamp(min=0))[:, 0], self.anchor))
        self.start += count
        self.done |= stop.any(1, keepdim=True) | (self.start >= self.end)
        self.ctx_feats.copy_(feats)
        self.ctx_pos.copy_(self.block_pos)

    def run_greedy(self, first_ctx) -> None:
        """Steps until every row has finished: the first drafts from ``first_ctx`` (the
        prompts' features and positions, eager), then replayed `greedy_step`s in runs, the
        host reading four numbers a row between runs (the one device-to-host copy)."""
        self.advance(lambda: self.draft(*first_ctx))
        first = self.first[:, 0].tolist()
        while True:
            done, start, end, steps = torch.cat([self.done, self.start, self.end, self.steps], 1).T.tolist()
            if all(done):
                return
            per_step = max(1.0, sum(s - f for s, f in zip(start, first)) / max(1, sum(steps)))
            remaining = max(e - s for e, s, d in zip(end, start, done) if not d)
            # never more steps than the budget needs (a step commits at most B tokens), or a
            # share of what the acceptance so far needs
            width = self.offsets.shape[1]
            run = max(-(-remaining // width), int(RUN_SHARE * remaining / per_step))
            if self.has_stops:  # a stop token can end a row any step: steps past it are wasted
                run = min(run, RUN_WITH_STOPS)
            for _ in range(run if self.block.is_cuda else 1):  # off a GPU reading the state costs nothing
                self.greedy_step()

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
                     clock=NO_CLOCK, graphs: bool = True):
    """`speculate` with fixed shapes: every block is B wide and both caches are slot buffers.

    The first draft step reads the prompt's features (any length) eagerly; later ones read
    the previous verify's B features. Greedy and untimed (`clock`), every step is decided on
    the device (`StaticSpeculator.advance`, one CUDA graph a step on a GPU) and the host
    reads the state only between runs of steps. Otherwise (sampling, or a clock that laps
    the parts of each step) each step copies one small tensor to the host (the accepted
    count and the tokens), which decides what is committed and when to stop.
    """
    mask_id = _check_request(model, input_ids, mask_token_id)
    stops = set(stop_token_ids or [])
    device = input_ids.device
    prompt_len, width = input_ids.shape[1], model.block_size
    rt = static_runtime(model, prompt_len + max_new_tokens + width,
                        lambda rt, size: rt.fits(model, target, size, graphs),
                        lambda size: StaticSpeculator(model, target, size, graphs))
    end = prompt_len + max_new_tokens - 1  # the last new token's position: no block slot there commits
    t0 = device_clock(device)
    logits, feats = rt.verifier.prefill(input_ids, logits_to_keep=1)
    anchor = _first_token(logits[0, -1], sampling, generator).view(1)
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
        usable = min(width, end - start) - 1  # drafts the budget can commit: the dynamic runtime's width - 1
        rt.set_block(anchor, start, mask_id)
        draft_probs = None
        if usable > 0:
            logits = (rt.draft(*first_ctx) if first_ctx else rt.draft_step())[0]  # (B-1, V)
            if sampling.greedy:
                rt.block[0, 1:] = logits.argmax(-1)
            else:
                draft_probs = sampling.probs(logits)
                rt.block[0, 1:] = torch.multinomial(draft_probs, 1, generator=generator)[:, 0]
        first_ctx = None
        clock.lap("draft")
        logits, step_feats = rt.verifier.step()
        clock.lap("verify")
        accepted, bonus = verify_drafts_on_device(rt.block[0, 1:], draft_probs, logits[0], sampling, generator,
                                                  usable)
        clock.lap("accept")
        host = torch.cat([accepted.view(1), bonus.view(1), rt.block[0, 1:]]).tolist()  # the step's one sync
        clock.lap("host")
        committed = _cut_after_stop(host[2 : 2 + host[0]] + [host[1]], stops)
        tokens += committed
        lengths.append(len(committed))
        # the next draft step writes these B features' context K/V; its mask shows the committed ones
        rt.ctx_feats.copy_(step_feats)
        rt.ctx_pos.copy_(rt.block_pos)
        anchor = bonus.view(1)
        clock.lap("bookkeeping")
    return SpecOutput.of_run(tokens, lengths, prompt_len, (t0, t1, device_clock(device)), clock, device)
