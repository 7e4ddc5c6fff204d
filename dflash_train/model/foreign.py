"""Drafters trained elsewhere, read into our DFlashDraftModel (`dflash-eval`, `drafter.init_from`).

Besides our own export, four layouts are read (config.json plus safetensors weights):

  z-lab        the reference runtime's release format (the `dflash` package, z-lab/*-DFlash on
               the Hub), which contract section 4 follows: architectures DFlashDraftModel,
               model_type qwen3, `block_size`, `num_target_layers`, `dflash_config`
               {mask_token_id, target_layer_ids}, unprefixed weight names.
  specforge    SpecForge's draft checkpoints (`save_pretrained` of its DFlashDraftModel; the
               pickled training_state.pt beside them is never read): the z-lab layout, plus
               SpecForge's own `dflash_config` settings (projector_type, attention_mode, ...).
  modelopt     NVIDIA Model-Optimizer's DFlash export (hf_spec_export.DFlashExporter): the z-lab
               layout without auto_map and with `dflash_config.causal` always written; a raw
               training state dict's `dflash_module.` prefix is stripped.
  speculators  vLLM speculators' DFlashSpeculatorConfig: `speculators_model_type: dflash`, the
               layer geometry in `transformer_layer_config` (only its non-default fields), layer
               ids in `aux_hidden_state_layer_ids` counted as hidden-state indices (ours + 1), and
               the target's frozen embed_tokens / lm_head stored beside the draft weights.

A setting our drafter does not implement (a causal block, attention sinks, shifted labels, a
reduced draft vocabulary, ...) is refused in one line naming the key: loading it anyway would
serve a drafter that computes something other than what it was trained to compute.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from dflash_train.model import dflash
from dflash_train.model.files import CONFIG_NAME, read_raw_config, weight_files
from dflash_train.model.dflash import (
    DEFAULT_BLOCK_SIZE,
    SLIDING_ATTENTION,
    DFlashConfig,
    DFlashDraftModel,
    default_target_layer_ids,
    rope_parameters,
)

OWN = "dflash-train"
FORMATS = ("z-lab", "specforge", "modelopt", "speculators")
# Our exports carry a verbatim copy of model/dflash.py; its first docstring line names it.
OWN_CODE_MARKER = '"""' + dflash.__doc__.splitlines()[0]

# SpecForge's draft model reads these from dflash_config; none of the other trainers writes them.
SPECFORGE_KEYS = frozenset({"projector_type", "attention_mode", "attention_modes", "shift_label",
                            "pure_draft_prefix_len"})
# Settings that change what the drafter computes: {key: (values we can serve, what another means)}.
# Read in `dflash_config` and, where a runtime also reads them there, at the top level.
SETTINGS = {
    "causal": ((False,), "a causal block (Model-Optimizer dflash_draft_attention=causal)"),
    "use_swa": ((False,), "a sliding window over the context in every layer"),
    "swa_window_size": ((None,), "a sliding window over the context in every layer"),
    "attention_sink_bias": ((False, None), "learned attention sinks"),
    "attention_mode": (("gqa", "mha"), "another attention parameterisation (MLA, KDA)"),
    "projector_type": ((None, "dflash"), "an extra logits head (Domino, DSpark)"),
    "shift_label": ((False,), "slot k trained on the token after x[p+k]"),
    "pure_draft_prefix_len": ((0,), "draft-only prefix slots"),
    "input_embedding_scale": ((1, 1.0), "scaled block embeddings"),
    "output_multiplier": ((1, 1.0), "scaled draft logits"),
    "final_logit_softcapping": ((None, 0, 0.0), "soft-capped draft logits"),
    "conv_kernel_size": ((None,), "DFlash2's dynamic convolutions"),
    "conv_group_size": ((None,), "DFlash2's dynamic convolutions"),
    "selector_rank": ((None,), "DFlash2's candidate selector"),
    "selector_top_k": ((None,), "DFlash2's candidate selector"),
}
TOP_LEVEL_SETTINGS = ("attention_sink_bias", "input_embedding_scale", "output_multiplier", "final_logit_softcapping",
                      "conv_kernel_size", "selector_rank")
MAPPED_KEYS = frozenset({"mask_token_id", "target_layer_ids", "block_size", "is_causal", "attention_modes"})
# Config keys that describe the file, not the drafter's architecture.
NOT_FIELDS = ("architectures", "auto_map", "model_type", "transformers_version", "dflash_config", "block_size",
              "num_target_layers", "quantization_config")
# Weights that belong to the target (frozen copies) or to a training loss, not to the drafter.
DROPPED_WEIGHTS = {
    "speculators": ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight",
                    "t2d", "d2t"),
    "modelopt": ("embed_tokens.weight", "lm_head.weight"),
}
MODELOPT_PREFIX = "dflash_module."


@dataclass
class MappedDrafter:
    """A foreign checkpoint in our terms: the config and the weights under our names."""

    format: str
    config: DFlashConfig
    state: dict[str, torch.Tensor]


def _is_own_export(path: Path) -> bool:
    code = path / "dflash.py"
    if not code.is_file():
        return False
    with code.open(encoding="utf-8", errors="replace") as f:
        return f.read(len(OWN_CODE_MARKER)) == OWN_CODE_MARKER


def detect_format(path: Path, raw: dict) -> str:
    """Which trainer wrote the checkpoint at ``path`` (``raw``: its config.json): OWN or one of FORMATS."""
    kind = raw.get("speculators_model_type")
    if kind is not None:
        if kind != "dflash":
            raise ValueError(f"{path / CONFIG_NAME}: a speculators {kind!r} checkpoint, not a DFlash drafter")
        return "speculators"
    archs = raw.get("architectures") or []
    if not any("DFlash" in str(a) for a in archs) and "dflash_config" not in raw:
        raise ValueError(f"{path / CONFIG_NAME}: not a DFlash drafter (architectures={archs}, no dflash_config); "
                         f"readable formats: {OWN}, {', '.join(FORMATS)}")
    if _is_own_export(path):
        return OWN
    nested = raw.get("dflash_config") or {}
    if "auto_map" not in raw and "causal" in nested:
        return "modelopt"
    if (path / "training_state.pt").exists() or SPECFORGE_KEYS & set(nested):
        return "specforge"
    return "z-lab"


def _refuse(fmt: str, file: Path, key: str, value, meaning: str) -> None:
    raise ValueError(f"{file}: {fmt} checkpoint sets {key}={value!r} ({meaning}), which this drafter does not "
                     "implement; it cannot be loaded without changing what it computes")


def _check_settings(fmt: str, file: Path, raw: dict, nested: dict) -> None:
    """Refuse every setting that would make the checkpoint compute something our drafter does not."""
    archs = [str(a) for a in raw.get("architectures") or []]
    if any(a.startswith("DFlash2") for a in archs):
        _refuse(fmt, file, "architectures", archs, "DFlash2: dynamic convolutions and a candidate selector")
    if raw.get("quantization_config") is not None:
        _refuse(fmt, file, "quantization_config", raw["quantization_config"], "quantized weights")
    if raw.get("hidden_act", "silu") != "silu":
        _refuse(fmt, file, "hidden_act", raw["hidden_act"], "an MLP activation other than SiLU")
    for key, value in nested.items():
        if key in MAPPED_KEYS:
            continue
        if key not in SETTINGS:
            raise ValueError(f"{file}: {fmt} checkpoint sets dflash_config.{key}={value!r}, a setting this loader "
                             "does not know; refusing to guess what it changes")
        allowed, meaning = SETTINGS[key]
        if value not in allowed:
            _refuse(fmt, file, f"dflash_config.{key}", value, meaning)
    for key in TOP_LEVEL_SETTINGS:
        allowed, meaning = SETTINGS[key]
        if raw.get(key) not in allowed + (None,):
            _refuse(fmt, file, key, raw[key], meaning)
    modes = nested.get("attention_modes")
    if modes is not None and any(str(m).lower() not in ("gqa", "mha") for m in modes):
        _refuse(fmt, file, "dflash_config.attention_modes", modes, "another attention parameterisation (MLA, KDA)")
    _check_block_causality(fmt, file, raw.get("is_causal", nested.get("is_causal")), raw.get("layer_types"))


def _check_block_causality(fmt: str, file: Path, is_causal, layer_types) -> None:
    """Ours: full-attention layers see the whole block, sliding layers only earlier slots (as
    vLLM and SGLang serve them); the reference runtime's `is_causal` can override either."""
    if is_causal is None:
        return
    types = layer_types or []
    if is_causal and any(t != SLIDING_ATTENTION for t in types or ["full_attention"]):
        _refuse(fmt, file, "is_causal", is_causal, "full-attention layers causal inside the block")
    if not is_causal and SLIDING_ATTENTION in types:
        _refuse(fmt, file, "is_causal", is_causal, "sliding-attention layers bidirectional inside the block")


def _require(fmt: str, file: Path, raw: dict, keys: tuple[str, ...], where: str = "") -> None:
    missing = [where + k for k in keys if raw.get(k) is None]
    if missing:
        raise ValueError(f"{file}: {fmt} checkpoint cannot be mapped: missing {', '.join(missing)}")


def _qwen3_layout_config(fmt: str, path: Path, raw: dict, num_target_layers: int | None) -> DFlashConfig:
    """z-lab, SpecForge and Model-Optimizer: the reference runtime's config, with its defaults
    (block size 16, the contract's layer spread) where a key is absent."""
    file = path / CONFIG_NAME
    nested = dict(raw.get("dflash_config") or {})
    _check_settings(fmt, file, raw, nested)
    _require(fmt, file, raw, ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                              "vocab_size"))
    mask_id = nested.get("mask_token_id", raw.get("mask_token_id"))
    if mask_id is None:
        raise ValueError(f"{file}: {fmt} checkpoint cannot be mapped: missing dflash_config.mask_token_id")
    blocks = {raw.get("block_size"), nested.get("block_size")} - {None}
    if len(blocks) > 1:
        raise ValueError(f"{file}: {fmt} checkpoint has block_size={raw['block_size']} but "
                         f"dflash_config.block_size={nested['block_size']}")
    n_target = raw.get("num_target_layers", num_target_layers)
    if n_target is None:
        raise ValueError(f"{file}: {fmt} checkpoint cannot be mapped: missing num_target_layers "
                         "(load it with its target to take the target's depth)")
    ids = nested.get("target_layer_ids") or default_target_layer_ids(n_target, raw["num_hidden_layers"])
    fields = {k: v for k, v in raw.items() if k not in NOT_FIELDS and k not in TOP_LEVEL_SETTINGS}
    return DFlashConfig(block_size=int(blocks.pop() if blocks else DEFAULT_BLOCK_SIZE), num_target_layers=int(n_target),
                        dflash_config={"mask_token_id": int(mask_id), "target_layer_ids": [int(i) for i in ids]},
                        **fields)


def _speculators_config(path: Path, raw: dict, num_target_layers: int | None) -> DFlashConfig:
    """speculators: geometry from `transformer_layer_config` completed with its config class's
    defaults, ids shifted from hidden-state indices to decoder-layer ids."""
    from transformers import AutoConfig

    file, fmt = path / CONFIG_NAME, "speculators"
    _require(fmt, file, raw, ("transformer_layer_config", "aux_hidden_state_layer_ids", "mask_token_id"))
    layer = dict(raw["transformer_layer_config"])
    base = AutoConfig.for_model(layer.pop("model_type", "qwen3"), **layer)
    vocab, draft_vocab = base.vocab_size, raw.get("draft_vocab_size", base.vocab_size)
    if draft_vocab != vocab:
        _refuse(fmt, file, "draft_vocab_size", draft_vocab, f"a draft vocabulary smaller than the target's {vocab}")
    if raw.get("target_hidden_size") not in (None, base.hidden_size):
        _refuse(fmt, file, "target_hidden_size", raw["target_hidden_size"],
                f"target features of another width than the drafter's {base.hidden_size}")
    if raw.get("sample_from_anchor"):
        _refuse(fmt, file, "sample_from_anchor", True, "the anchor slot drafting, every slot one token later")
    types = list(getattr(base, "layer_types", None) or ["full_attention"] * base.num_hidden_layers)
    if raw.get("sliding_window_non_causal") and SLIDING_ATTENTION in types:
        _refuse(fmt, file, "sliding_window_non_causal", True, "sliding-attention layers bidirectional in the block")
    if getattr(base, "hidden_act", "silu") != "silu":
        _refuse(fmt, file, "transformer_layer_config.hidden_act", base.hidden_act, "an MLP activation other than SiLU")
    # speculators counts hidden states (index 0 is the embedding output); we count decoder layers.
    aux = [int(i) for i in raw["aux_hidden_state_layer_ids"]]
    if min(aux) < dflash.EMBEDDING_OFFSET:
        _refuse(fmt, file, "aux_hidden_state_layer_ids", aux, "the embedding output as a feature")
    if num_target_layers is None:
        raise ValueError(f"{file}: speculators checkpoint cannot be mapped without its target: it does not record "
                         "the target's number of layers")
    heads = base.num_attention_heads
    rope = rope_parameters(base)
    return DFlashConfig(
        block_size=int(raw.get("block_size", 8)),  # DFlashSpeculatorConfig's own default
        num_target_layers=int(num_target_layers),
        dflash_config={"mask_token_id": int(raw["mask_token_id"]),
                       "target_layer_ids": [i - dflash.EMBEDDING_OFFSET for i in aux]},
        hidden_size=base.hidden_size, intermediate_size=base.intermediate_size, num_attention_heads=heads,
        num_key_value_heads=getattr(base, "num_key_value_heads", None) or heads,
        head_dim=getattr(base, "head_dim", None) or base.hidden_size // heads, rms_norm_eps=base.rms_norm_eps,
        max_position_embeddings=base.max_position_embeddings, vocab_size=vocab,
        num_hidden_layers=base.num_hidden_layers, attention_bias=bool(getattr(base, "attention_bias", False)),
        layer_types=types, sliding_window=getattr(base, "sliding_window", None), hidden_act="silu",
        rope_theta=rope["rope_theta"], rope_scaling=None if rope.get("rope_type", "default") == "default" else rope,
        rope_parameters=rope,
    )


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """All safetensors weights of a checkpoint folder (one file or an index of shards); pickle
    files are never opened (unpickling runs code)."""
    files = weight_files(path)
    state = {}
    for name in files:
        try:
            state.update(load_file(str(path / name)))
        except (SafetensorError, OSError, ValueError) as err:
            raise ValueError(f"{path / name}: unreadable safetensors file (truncated or corrupt): {err}") from None
    return state


def map_weights(fmt: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Foreign weight names to ours: prefixes stripped, target copies and buffers dropped."""
    if fmt == "modelopt" and any(MODELOPT_PREFIX in k for k in state):
        state = {k.split(MODELOPT_PREFIX, 1)[1]: v for k, v in state.items() if MODELOPT_PREFIX in k}
    dropped = DROPPED_WEIGHTS.get(fmt, ())
    return {k: v for k, v in state.items() if k not in dropped and "rotary_emb" not in k}


def check_mapped_names(fmt: str, path: Path, config: DFlashConfig, state: dict) -> None:
    """One line naming the weights the config needs and the checkpoint lacks (or the reverse)."""
    with torch.device("meta"):
        expected = set(DFlashDraftModel(config).state_dict())
    missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing:
        raise ValueError(f"{path}: {fmt} checkpoint cannot be mapped: missing weight(s) {missing[:4]}"
                         f"{f' and {len(missing) - 4} more' if len(missing) > 4 else ''} "
                         f"(its config has {config.num_hidden_layers} layers)")
    if extra:
        raise ValueError(f"{path}: {fmt} checkpoint holds weight(s) this drafter has no place for: {extra[:4]}"
                         f"{f' and {len(extra) - 4} more' if len(extra) > 4 else ''}")


def read_foreign(path, num_target_layers: int | None = None) -> MappedDrafter | None:
    """The drafter at ``path`` mapped onto ours, or None when it is our own export (read as is).

    num_target_layers: the target's depth, for formats that do not record it (speculators).
    """
    path = Path(path)
    raw = read_raw_config(path)
    fmt = detect_format(path, raw)
    if fmt == OWN:
        return None
    if fmt == "speculators":
        config = _speculators_config(path, raw, num_target_layers)
    else:
        config = _qwen3_layout_config(fmt, path, raw, num_target_layers)
    state = map_weights(fmt, read_weights(path))
    check_mapped_names(fmt, path, config, state)
    return MappedDrafter(fmt, config, state)
