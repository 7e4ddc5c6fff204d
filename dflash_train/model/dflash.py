"""DFlash drafter: one file for training, inference and `trust_remote_code` loading.

This file is copied verbatim beside exported weights as `dflash.py`, so it imports only
torch and transformers and works with transformers 4.57.x and 5.x. It holds the model and
the reference decoding loop a user runs after `trust_remote_code` loading (`spec_generate`,
growing caches, batch 1). The project's faster runtimes (the static CUDA-graph one, its
device loop, the batched loops) are not exported: they live in model/runtime.py and
eval/, and import this file.

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
    layer_class = DecoderLayer  # a drafter kind with other layers (dflash2.py) names its own
    # A step's block is cut to the tokens the request may still commit (dspark.py runs its whole block)
    narrows_last_block = True

    def __init__(self, config):
        super().__init__(config)
        self.target_layer_ids = [int(i) for i in dflash_field(config, "target_layer_ids")]
        self.mask_token_id = dflash_field(config, "mask_token_id")
        self.block_size = block_size_of(config)
        self.layers = nn.ModuleList(self.layer_class(config, i) for i in range(config.num_hidden_layers))
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
    def draft_hidden(self, target, block_ids, new_features, start: int, cache: ContextCache) -> torch.Tensor:
        """One denoising step: hidden states of the block at `start`, after the final norm: (1, L, H)."""
        width = block_ids.shape[1]
        c = new_features.shape[1]
        positions = torch.arange(start - c, start + width, device=block_ids.device)[None]
        noise = target.get_input_embeddings()(block_ids)
        return self(noise, new_features, positions, self.inference_masks(start, width, block_ids.device), cache, True)

    @torch.inference_mode()
    def draft(self, target, block_ids, new_features, start: int, cache: ContextCache) -> torch.Tensor:
        """One denoising step: logits for slots 1..L-1 of the block at `start`: (1, L-1, V)."""
        hidden = self.draft_hidden(target, block_ids, new_features, start, cache)
        return target.get_output_embeddings()(hidden[:, 1:])

    @property
    def drafts_per_block(self) -> int:
        """Tokens one drafter forward proposes: slots 1..B-1 (slot 0 holds the anchor)."""
        return self.block_size - 1

    def first_block(self, anchor: int, room: int, mask_id: int, device) -> torch.Tensor:
        """(1, W) the block a step drafts: the anchor, then mask tokens; W = min(B, ``room``),
        or B for a kind that always runs its whole block."""
        width = min(self.block_size, room) if self.narrows_last_block else self.block_size
        block = torch.full((1, width), mask_id, dtype=torch.long, device=device)
        block[0, 0] = anchor
        return block

    def pick_drafts(self, target, hidden: torch.Tensor, anchor: torch.Tensor, count: int, sampling: "Sampling",
                    generator):
        """Drafts (b, count) from the block's outputs ``hidden`` (b, W, H) after the anchors
        ``anchor`` (b,), and, when sampling, the distributions they were drawn from
        (b, count, V) (None when greedy). Fixed shapes and no host reads: every runtime picks
        drafts here, and the static one captures the greedy pick in its CUDA graphs. DFlash:
        slots 1..count through the target's head. A kind with its own way of picking
        (dflash2.py's selector walk, dspark.py's Markov head) overrides this."""
        logits = target.get_output_embeddings()(hidden[:, 1 : count + 1])  # (b, count, V)
        if sampling.greedy:
            return logits.argmax(-1), None
        probs = sampling.probs(logits)
        return torch.multinomial(probs.flatten(0, 1), 1, generator=generator).view(probs.shape[:2]), probs

    @torch.inference_mode()
    def propose(self, target, anchor: int, n: int, room: int, new_features, start: int, cache: ContextCache,
                mask_id: int, sampling: "Sampling", generator):
        """The first ``n`` drafts after ``anchor`` and, when sampling, the distributions they
        were drawn from: ((n,) long, (n, V) or None). ``room``: tokens the request may still
        commit; the block is cut to it (`first_block`), so a short last block is drafted as
        the width it is."""
        block = self.first_block(anchor, room, mask_id, new_features.device)
        hidden = self.draft_hidden(target, block, new_features, start, cache)
        drafts, probs = self.pick_drafts(target, hidden, block[:, 0], n, sampling, generator)
        return drafts[0], None if probs is None else probs[0]

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
        verify_tokens: int | None = None,
    ):
        """Speculative decoding with `target` (an HF causal LM); batch size 1. See `speculate`.

        time_steps: fill `SpecOutput.step_times` (draft, verify, bookkeeping seconds); on a
        GPU this synchronises the device at every boundary, so leave it off when only
        throughput matters.
        verify_tokens: drafts the target verifies per step, 1..drafts_per_block (None: all
        of them; B-1 for DFlash). The drafter still drafts the whole block it was trained on; a shorter
        verify costs the target less per step and commits at most verify_tokens + 1 tokens.
        """
        self.eval()
        result = speculate(
            self, target, input_ids, max_new_tokens, Sampling(temperature, top_p, top_k),
            stop_token_ids, mask_token_id, generator, StepClock(input_ids.device) if time_steps else NO_CLOCK,
            verify_tokens,
        )
        return result if return_stats else result.output_ids


def check_verify_tokens(verify_tokens: int | None, block_size: int) -> int:
    """The drafts verified per step: ``verify_tokens``, or all B-1 of a block when None.
    ValueError naming a value outside 1..B-1. (A drafter whose block of B proposes B
    drafts, DSpark's, passes B + 1.)"""
    if verify_tokens is None:
        return block_size - 1
    if isinstance(verify_tokens, bool) or not isinstance(verify_tokens, int) or not 1 <= verify_tokens < block_size:
        raise ValueError(f"verify_tokens={verify_tokens!r}: must be an integer in 1..{block_size - 1} (the drafts of a "
                         f"block of {block_size}) or null for all of them")
    return verify_tokens


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


def first_token(logits, sampling: Sampling, generator) -> torch.Tensor:
    if sampling.greedy:
        return logits.argmax(-1)
    return torch.multinomial(sampling.probs(logits), 1, generator=generator)[0]


def cut_after_stop(committed: list[int], stops: set) -> list[int]:
    for i, tok in enumerate(committed):
        if tok in stops:
            return committed[: i + 1]
    return committed


def stalled(step: int, row: int = 0) -> RuntimeError:
    """The error for a decode step that committed no token. Every step commits at least the
    target's own next token; the loops end on a length or a stop token, so a step that
    commits nothing would be repeated forever."""
    return RuntimeError(f"decode step {step} of row {row} committed no token: the loop cannot advance")


def check_request(model, input_ids, mask_token_id) -> int:
    """The mask id to fill blocks with; raises on what the runtimes cannot serve."""
    if input_ids.shape[0] != 1:
        raise ValueError(f"spec_generate supports batch size 1, got input_ids of shape {tuple(input_ids.shape)}")
    mask_id = model.mask_token_id if mask_token_id is None else mask_token_id
    if mask_id is None:
        raise ValueError("no mask_token_id: pass one or set dflash_config.mask_token_id in the drafter config")
    return mask_id


@torch.inference_mode()
def speculate(model, target, input_ids, max_new_tokens, sampling, stop_token_ids, mask_token_id, generator,
              clock=NO_CLOCK, verify_tokens: int | None = None):
    """Draft a block with `model`, verify its first drafts with `target` in one forward, commit, repeat.

    The drafter's cache holds only context K/V; the target's cache is cropped to the
    committed tokens after every step. Each step's new context features are the target's
    features of the tokens it just committed (the anchor and the accepted drafts).
    verify_tokens: drafts verified per step (`check_verify_tokens`; None: the whole block).
    """
    from transformers import DynamicCache

    mask_id = check_request(model, input_ids, mask_token_id)
    most = check_verify_tokens(verify_tokens, model.drafts_per_block + 1)  # drafts verified per step
    stops = set(stop_token_ids or [])
    device = input_ids.device
    prompt_len = input_ids.shape[1]
    t0 = device_clock(device)
    target_cache = DynamicCache()
    out = target(input_ids, past_key_values=target_cache, use_cache=True, output_hidden_states=True)
    tokens = input_ids[0].tolist() + [int(first_token(out.logits[0, -1], sampling, generator))]
    new_features = target_features(out.hidden_states, model.target_layer_ids)  # (1, prompt, n*H)
    draft_cache = ContextCache()
    t1 = device_clock(device)
    lengths = []
    while len(tokens) - prompt_len < max_new_tokens and tokens[-1] not in stops:
        clock.lap()
        start = len(tokens) - 1  # the anchor: last committed token, not yet seen by the target
        # n drafts commit at most n + 1 tokens (the accepted drafts and the target's next)
        room = max_new_tokens - (len(tokens) - prompt_len)
        n = min(most, room - 1)
        block = torch.tensor([tokens[-1:]], dtype=torch.long, device=device)  # (1, 1 + n) once drafted
        draft_probs = None
        if n > 0:
            drafts, draft_probs = model.propose(target, tokens[-1], n, room, new_features, start, draft_cache,
                                                mask_id, sampling, generator)
            block = torch.cat([block, drafts[None]], dim=1)
        clock.lap("draft")
        checked = block.shape[1]
        positions = torch.arange(start, start + checked, device=device)[None]
        out = target(block, position_ids=positions, past_key_values=target_cache, use_cache=True,
                     output_hidden_states=True)
        accepted, bonus = verify_drafts(block[0, 1:], draft_probs, out.logits[0], sampling, generator)
        clock.lap("verify")
        committed = cut_after_stop(block[0, 1 : accepted + 1].tolist() + [int(bonus)], stops)
        if not committed:
            raise stalled(len(lengths))
        tokens += committed
        lengths.append(len(committed))
        _crop(target_cache, len(tokens) - 1)
        new_features = target_features(out.hidden_states, model.target_layer_ids)[:, : accepted + 1]
        clock.lap("bookkeeping")
    return SpecOutput.of_run(tokens, lengths, prompt_len, (t0, t1, device_clock(device)), clock, device)
