"""Starting a drafter: its config from a recipe, its weights from the target's own decoder
layers (``drafter.init_from_target``) or from a saved drafter (``drafter.init_from``).

Draft layer i starts from target layer L - n + i: the target's last n layers (n draft
layers, L target layers). Those are the layers that turn the target's mid-depth features
into next-token predictions and feed its final norm and LM head, which the drafter shares;
the drafter's job is the same mapping, from fused features of its context. Every tensor
whose name and shape match is copied (q/k/v/o projections, MLP, input and post-attention
norms; q_norm/k_norm only if the target has them, as Qwen3 does). The drafter's final
``norm`` starts from the target's final norm, the one its LM head was trained behind.
``fc`` and ``hidden_norm`` have no counterpart and stay freshly initialised, as do q/k
biases (Qwen2's) that the drafter does not have.

``drafter.init_from=DIR`` starts every weight from a saved drafter instead: one of ours, or one
from another trainer (z-lab, SpecForge, Model-Optimizer, speculators; see model/foreign.py).
Its geometry must be the one the recipe builds; a difference is an error naming the setting.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from dflash_train.model.dflash import DFlashConfig
from dflash_train.contract import check_kind
from dflash_train.model.dflash2 import KERNEL_PROJECTION_PARAMS, conv_delta_scale
from dflash_train.model.kinds import KINDS, kind_of
from dflash_train.model.target import decoder_layers

if TYPE_CHECKING:
    from dflash_train.config import TrainConfig


def drafter_config(cfg: TrainConfig, target_hf_config) -> DFlashConfig:
    """The drafter's config for a recipe: attention geometry and RoPE follow the target;
    ``drafter.kind`` picks the config class, and its own settings come from drafter.<kind>.
    A DFlash2 run's conv_delta_scale rides along as a training-only attribute: the drafter
    trained (and the one a checkpoint is exported from) applies it, the export folds it."""
    d = cfg.drafter
    training = {"conv_delta_scale": d.dflash2.conv_delta_scale} if d.kind == "dflash2" else {}
    return KINDS[check_kind(d.kind)][0].from_target(
        target_hf_config, mask_token_id=cfg.target.mask_token_id, num_hidden_layers=d.num_hidden_layers,
        block_size=d.block_size, target_layer_ids=d.target_layer_ids, num_features=d.num_features,
        **kind_settings(d, cfg.data.num_anchors), **training,
    )


def kind_settings(d, num_anchors: int | None = None) -> dict:
    """The model settings of ``d.kind`` (a DrafterConfig) that its config class takes
    (``num_anchors``: the recipe's, which a DSpark config.json records)."""
    if d.kind == "dflash2":
        s = d.dflash2
        return dict(conv_kernel_size=s.conv_kernel_size, conv_group_size=s.conv_group_size,
                    selector_rank=s.selector_rank, selector_top_k=s.selector_top_k)
    if d.kind == "dspark":
        extra = {} if num_anchors is None else {"num_anchors": num_anchors}
        return dict(markov_rank=d.markov_rank, markov_head_type=d.markov_head_type, **extra)
    return {}


def source_layers(num_draft_layers: int, num_target_layers: int) -> list[int]:
    """The target layer each draft layer starts from: the last ``num_draft_layers``."""
    if num_draft_layers > num_target_layers:
        raise ValueError(f"drafter.init_from_target with drafter.num_hidden_layers={num_draft_layers} needs a "
                         f"target with at least as many layers; it has {num_target_layers}")
    return [num_target_layers - num_draft_layers + i for i in range(num_draft_layers)]


@torch.no_grad()
def init_from_target(drafter: nn.Module, target: nn.Module) -> dict[str, str]:
    """Copy matching target weights into ``drafter`` in place; returns {drafter name: target name}."""
    t_layers = decoder_layers(target)
    copied: dict[str, str] = {}

    def copy(dst_prefix: str, dst: nn.Module, src_prefix: str, src: nn.Module) -> None:
        src_params = dict(src.named_parameters())
        for name, param in dst.named_parameters():
            other = src_params.get(name)
            if other is not None and other.shape == param.shape:
                param.copy_(other.to(param.dtype))
                copied[dst_prefix + name] = src_prefix + name

    for i, j in enumerate(source_layers(len(drafter.layers), len(t_layers))):
        copy(f"layers.{i}.", drafter.layers[i], f"model.layers.{j}.", t_layers[j])
    norm = getattr(getattr(target, "model", target), "norm", None)
    if norm is not None and norm.weight.shape == drafter.norm.weight.shape:
        drafter.norm.weight.copy_(norm.weight.to(drafter.norm.weight.dtype))
        copied["norm.weight"] = "model.norm.weight"
    return copied


def init_summary(copied: dict[str, str]) -> str:
    """What init_from_target copied, in words: "target layers 19-23 and the final norm"."""
    layers = sorted({int(name.split(".")[2]) for name in copied.values() if name.startswith("model.layers.")})
    spans = f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else (str(layers[0]) if layers else "")
    parts = [f"target layer{'s' if len(layers) > 1 else ''} {spans}"] if layers else []
    parts += ["the final norm"] if "norm.weight" in copied else []
    return " and ".join(parts) or "nothing of the target"


# Settings a warm start must share with the recipe: {config field: the setting that sets it}.
SAME_AS_RECIPE = {
    "num_hidden_layers": "drafter.num_hidden_layers",
    "block_size": "drafter.block_size",
    "target_layer_ids": "drafter.target_layer_ids",
    "mask_token_id": "target.mask_token_id",
    "layer_types": "the target's layer types",
    "sliding_window": "the target's sliding window",
    "hidden_size": "the target's hidden size",
    "intermediate_size": "the target's intermediate size",
    "num_attention_heads": "the target's attention heads",
    "num_key_value_heads": "the target's key/value heads",
    "head_dim": "the target's head_dim",
    "rms_norm_eps": "the target's rms_norm_eps",
    "rope": "the target's RoPE",
}


def _geometry(config) -> dict:
    from dflash_train.model.dflash import dflash_field, rope_parameters

    layers = config.num_hidden_layers
    out = {name: getattr(config, name, None) for name in SAME_AS_RECIPE}
    out.update(block_size=int(dflash_field(config, "block_size")), mask_token_id=int(dflash_field(config, "mask_token_id")),
               target_layer_ids=[int(i) for i in dflash_field(config, "target_layer_ids")],
               layer_types=list(config.layer_types or ["full_attention"] * layers), rope=rope_parameters(config))
    if "sliding_attention" not in out["layer_types"]:
        out["sliding_window"] = None  # unused without sliding layers
    return out


def init_from_checkpoint(drafter: nn.Module, path: str, target, target_weights: str | None = None,
                         allow_other_target: bool = False) -> None:
    """Replace every weight of ``drafter`` with those of the saved drafter at ``path``
    (checked against ``target``, a TargetModel); its geometry must equal ``drafter``'s, and
    an export of ours must have been trained for ``target_weights`` (the target's
    ``weights_digest``) unless ``allow_other_target``."""
    from dflash_train.model.io import check_target_weights, load_drafter

    try:
        loaded = load_drafter(path, target=target)
        if target_weights and not allow_other_target:
            check_target_weights(loaded.config, target_weights, "drafter.init_from_other_target=true")
    except ValueError as err:
        raise ValueError(f"drafter.init_from={path}: {err}") from None
    theirs, mine = kind_of(loaded.config), kind_of(drafter.config)
    if theirs != mine:
        raise ValueError(f"drafter.init_from={path}: the checkpoint is a {theirs} drafter but this run builds a {mine} "
                         f"one (drafter.kind); set drafter.kind={theirs}")
    if kind_of(drafter.config) == "dspark" and drafter.config.markov_rank != loaded.config.markov_rank:
        raise ValueError(f"drafter.init_from={path}: the checkpoint has markov_rank={loaded.config.markov_rank} but "
                         f"this run builds {drafter.config.markov_rank} (drafter.markov_rank); set the run to match")
    mine, theirs = _geometry(drafter.config), _geometry(loaded.config)
    diff = [name for name in SAME_AS_RECIPE if mine[name] != theirs[name]]
    if diff:
        name = diff[0]
        raise ValueError(f"drafter.init_from={path}: the checkpoint has {name}={theirs[name]} but this run builds "
                         f"{mine[name]} ({SAME_AS_RECIPE[name]}); set the run to match the checkpoint")
    state = loaded.state_dict()
    if kind_of(drafter.config) == "dflash2":
        state = _unfold_conv_delta_scale(state, conv_delta_scale(drafter.config), path)
    drafter.load_state_dict(state)  # copied into the drafter's own dtype


def _unfold_conv_delta_scale(state: dict, scale: float, path: str) -> dict:
    """A saved DFlash2 drafter's weights for a run whose kernel projections are multiplied by
    ``scale`` (drafter.dflash2.conv_delta_scale): each divided by it, so the run starts from
    the drafter that was saved. At 0 only zero projections (a fresh or frozen drafter's) can be."""
    if scale == 1:
        return state
    names = [k for k in state if k.endswith(KERNEL_PROJECTION_PARAMS)]
    if scale == 0:
        moved = [k for k in names if bool(state[k].any())]
        if moved:
            raise ValueError(f"drafter.init_from={path}: its dynamic convolution kernels are not zero ({moved[0]}), "
                             "and drafter.dflash2.conv_delta_scale=0 would drop them; use a scale > 0")
        return state
    return {k: v / scale if k in names else v for k, v in state.items()}
