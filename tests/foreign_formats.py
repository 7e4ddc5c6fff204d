"""Drafter checkpoints in other trainers' on-disk layouts, written from one of our drafters.

Each writer puts the drafter's weights under the names, and its settings under the
config.json keys, that the trainer itself writes (see dflash_train/model/foreign.py for the
sources). The z-lab layout is written by the reference runtime's own model class
(`dflash.model.DFlashDraftModel.save_pretrained`), so it is exactly what that runtime saves.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Qwen3Config

from dflash_train.model.dflash import dflash_field, rope_parameters


def _geometry(cfg) -> dict:
    return dict(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
                max_position_embeddings=cfg.max_position_embeddings, vocab_size=cfg.vocab_size,
                num_hidden_layers=cfg.num_hidden_layers)


def _dflash(cfg) -> dict:
    return {"mask_token_id": int(dflash_field(cfg, "mask_token_id")),
            "target_layer_ids": [int(i) for i in dflash_field(cfg, "target_layer_ids")]}


def zlab_config(cfg) -> dict:
    """The keys of a z-lab release config.json (z-lab/Qwen3-8B-DFlash-b16; SpecForge's
    configs/qwen3-8b-dflash.json template has the same)."""
    n = cfg.num_hidden_layers
    return {"architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": int(dflash_field(cfg, "block_size")),
            "bos_token_id": 1, "dflash_config": _dflash(cfg), "dtype": "float32", "eos_token_id": 2,
            "hidden_act": "silu", "initializer_range": 0.02, "layer_types": ["full_attention"] * n,
            "max_window_layers": n, "model_type": "qwen3", "num_target_layers": cfg.num_target_layers,
            "rope_scaling": None, "rope_theta": rope_parameters(cfg)["rope_theta"], "sliding_window": None,
            "tie_word_embeddings": False, "use_cache": True, "use_sliding_window": False, **_geometry(cfg)}


def write_zlab(out: Path, drafter, config_edit=None) -> torch.nn.Module:
    """The reference runtime's model holding ``drafter``'s weights, saved by its own
    ``save_pretrained``, with the runtime's modeling file beside it as Hub repos ship it.
    Returns the reference model (for comparing forwards)."""
    import dflash.model as reference

    raw = zlab_config(drafter.config)
    if config_edit:
        config_edit(raw)
    model = reference.DFlashDraftModel(Qwen3Config(**raw)).eval()
    model.load_state_dict(drafter.state_dict())  # the same names: we read the reference's layout as is
    model.save_pretrained(out)
    shutil.copyfile(reference.__file__, Path(out) / "dflash.py")
    return model


def write_specforge(out: Path, drafter) -> Path:
    """A SpecForge checkpoint folder (scripts/train_dflash.py: epoch_E_step_S/): its draft model's
    save_pretrained (the z-lab layout, `rope_theta` restored by apply_legacy_rope_scaling) beside
    the pickled training_state.pt, which must never be unpickled."""
    import dflash.model as reference

    ckpt = Path(out) / "epoch_0_step_8"
    model = reference.DFlashDraftModel(Qwen3Config(**zlab_config(drafter.config)))
    model.load_state_dict(drafter.state_dict())
    model.save_pretrained(ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["rope_theta"] = config["rope_parameters"]["rope_theta"]
    (ckpt / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    (ckpt / "training_state.pt").write_bytes(b"\x80\x04 a pickle that loading would have to run")
    return ckpt


def modelopt_config(cfg) -> dict:
    """The config.json Model-Optimizer 0.47's DFlashExporter._export_config writes, in its order."""
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": int(dflash_field(cfg, "block_size")),
            "dflash_config": {**_dflash(cfg), "causal": False}, "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
            "intermediate_size": cfg.intermediate_size, "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
            "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_position_embeddings,
            "initializer_range": 0.02, "attention_bias": False, "attention_dropout": 0.0,
            "rope_theta": rope_parameters(cfg)["rope_theta"], "rope_scaling": None, "tie_word_embeddings": False,
            "torch_dtype": "float32", "num_target_layers": cfg.num_target_layers,
            "layer_types": ["full_attention"] * cfg.num_hidden_layers}


def write_modelopt(out: Path, drafter, target=None, config_edit=None) -> Path:
    """Model-Optimizer's export folder: its config and the draft module's weights, the
    `dflash_module.` prefix stripped. With ``target``: the raw training state dict instead
    (prefix kept, the base model's weights beside it), as its warm start also accepts."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    raw = modelopt_config(drafter.config)
    if config_edit:
        config_edit(raw)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    state = {k: v.detach().clone().contiguous() for k, v in drafter.state_dict().items()}
    if target is not None:
        state = {"dflash_module." + k: v for k, v in state.items()}
        state.update({k: v.detach().clone().contiguous() for k, v in target.state_dict().items()})
    save_file(state, str(out / "model.safetensors"))
    return out


def speculators_config(cfg, verifier: str) -> dict:
    """vLLM speculators' DFlashSpeculatorConfig as saved: the draft layers' Qwen3 config as its
    diff against the defaults, hidden-state indices for the layer ids (ours + 1)."""
    layer = Qwen3Config(**_geometry(cfg), rope_parameters=rope_parameters(cfg), tie_word_embeddings=False,
                        layer_types=["full_attention"] * cfg.num_hidden_layers).to_diff_dict()
    block = int(dflash_field(cfg, "block_size"))
    ids = _dflash(cfg)["target_layer_ids"]
    return {"architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash", "speculators_version": "0.5.0",
            "transformer_layer_config": layer, "draft_vocab_size": cfg.vocab_size, "block_size": block,
            "target_hidden_size": None, "aux_hidden_state_layer_ids": [i + 1 for i in ids],
            "mask_token_id": _dflash(cfg)["mask_token_id"], "sliding_window_non_causal": False,
            "sample_from_anchor": False, "torch_dtype": "float32",
            "speculators_config": {"algorithm": "dflash", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": block - 1}],
                                   "verifier": {"name_or_path": verifier, "architectures": ["Qwen3ForCausalLM"]}}}


def write_speculators(out: Path, drafter, target, config_edit=None) -> Path:
    """A speculators DFlash folder: the draft weights plus its frozen copies of the target's
    embedding and LM head (verifier_lm_head and verifier_norm are not saved)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    raw = speculators_config(drafter.config, "tiny-target")
    if config_edit:
        config_edit(raw)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    state = {k: v.detach().clone().contiguous() for k, v in drafter.state_dict().items()}
    state["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().clone()
    state["lm_head.weight"] = target.get_output_embeddings().weight.detach().clone()
    save_file(state, str(out / "model.safetensors"))
    return out
