"""Drafter checkpoints in the contract's on-disk format (section 4), saved and loaded safely.

An export directory holds `config.json`, `model.safetensors` (unprefixed names, no
embedding, no LM head) and `dflash.py` (a verbatim copy of `dflash_train/model/dflash.py`,
so `AutoModel.from_pretrained(dir, trust_remote_code=True)` runs our own code). A DFlash2
drafter (`drafter.kind=dflash2`) also carries `dflash2.py`, which imports `dflash.py`
beside it; its config.json names `DFlash2DraftModel` and holds the four DFlash2 keys in
`dflash_config`, the layout SGLang and vLLM read (model/dflash2.py). A training run's
`conv_delta_scale` is folded into the kernel projections' weights and not written.

A DSpark drafter (model/dspark.py) is written in DeepSpec's layout, the one SGLang and vLLM
read: `architectures: ["Qwen3DSparkModel"]`, its fields at the top level of config.json,
`markov_head.*` and `confidence_head.*` weights, and no code file (no engine runs ours).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash_train.atomic import atomic_write
from dflash_train.model import dflash, dflash2
from dflash_train.model.dflash import (
    DFlashConfig,
    DFlashDraftModel,
    block_size_of,
    dflash_field,
    rope_parameters,
)
from dflash_train.model.dspark import ARCHITECTURE as DSPARK_ARCHITECTURE
from dflash_train.model.dspark import is_dspark, top_level_fields
from dflash_train.model.files import read_raw_config
from dflash_train.model.foreign import read_foreign, read_weights
from dflash_train.model.kinds import ARCHITECTURES, config_class, kind_of, new_drafter
from dflash_train.model.serving import layer_types, serving_conflicts, serving_fields

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
CODE_NAME = "dflash.py"
# Written beside the drafter by model/card.py: the model card, the recipe, the data manifest.
CARD_NAME = "README.md"
RECIPE_NAME = "recipe.yaml"
MANIFEST_NAME = "data_manifest.json"
EXPORT_FILES = (CONFIG_NAME, WEIGHTS_NAME, CODE_NAME, dflash2.CODE_NAME, CARD_NAME, RECIPE_NAME, MANIFEST_NAME)
# The modelling files beside each kind's weights: {kind: (module, file name)}.
CODE_FILES = {"dflash": ((dflash, CODE_NAME),), "dflash2": ((dflash, CODE_NAME), (dflash2, dflash2.CODE_NAME)),
              "dspark": ()}  # no engine runs our code for DSpark: DeepSpec's layout, no code file
REQUIRED_KEYS = (
    "architectures", "model_type", "auto_map", "block_size", "num_target_layers", "num_hidden_layers",
    "dflash_config", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size",
)
# A DSpark export has no code file, so no auto_map; DeepSpec's own model class asserts these top-level keys.
DSPARK_REQUIRED_KEYS = tuple(k for k in REQUIRED_KEYS if k != "auto_map") + (
    "mask_token_id", "target_layer_ids", "markov_rank", "markov_head_type", "enable_confidence_head",
    "confidence_head_with_markov", "num_anchors",
)
# Keys that make a runtime read the checkpoint differently than our semantics.
FORBIDDEN_KEYS = ("eagle_aux_hidden_state_layer_ids",)
# config.json key of the target's weights digest (model/target.py's weights_digest) at export.
TARGET_WEIGHTS_KEY = "dflash_target_weights"
_NOT_CONFIG_FIELDS = ("model_type", "transformers_version", "architectures", "auto_map")


def export_config(config) -> dict:
    """The config.json dict: 4.x (`rope_theta`) and 5.x (`rope_parameters`) readers both work."""
    out = config.to_dict()
    rope = rope_parameters(config)
    for key in FORBIDDEN_KEYS + dflash2.TRAINING_ONLY:  # the latter folded into the weights (save_drafter)
        out.pop(key, None)
    serving_top, serving_nested = serving_fields(config)  # what vLLM and SGLang read (model/serving.py)
    kind = kind_of(config)
    # DFlash2's keys: SGLang and vLLM read them in dflash_config only.
    kind_nested = {k: int(dflash_field(config, k)) for k in dflash2.DEFAULTS} if kind == "dflash2" else {}
    architecture = next(a for a, k in ARCHITECTURES.items() if k == kind)
    out.update(
        architectures=[architecture],
        model_type="qwen3",
        auto_map=({"AutoModel": f"{CODE_FILES[kind][-1][1].removesuffix('.py')}.{architecture}"}
                  if CODE_FILES[kind] else None),  # dspark: no code file (dspark_export_config drops the key)
        block_size=block_size_of(config),
        num_target_layers=int(config.num_target_layers),
        dflash_config={
            "mask_token_id": int(dflash_field(config, "mask_token_id")),
            "target_layer_ids": [int(i) for i in dflash_field(config, "target_layer_ids")],
            **serving_nested,
            **kind_nested,
        },
        rope_theta=rope["rope_theta"],
        rope_scaling=None if rope.get("rope_type", "default") == "default" else rope,
        rope_parameters=rope,
        hidden_act="silu",
        tie_word_embeddings=False,
        layer_types=layer_types(config),
        **serving_top,
    )
    return out


def dspark_export_config(config) -> dict:
    """A DSpark drafter's config.json: the DFlash keys (backbone geometry, serving keys) plus
    DeepSpec's top-level DSpark fields, architecture Qwen3DSparkModel, no auto_map. Never
    ``speculators_model_type``: SGLang refuses a checkpoint that names speculators' dspark."""
    out = export_config(config)
    out.pop("auto_map", None)
    out.update(architectures=[DSPARK_ARCHITECTURE], **top_level_fields(config))
    return out


def _write_export(state: dict, config_dict: dict, tmp: Path) -> None:
    (tmp / CONFIG_NAME).write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
    save_file(state, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
    kind = ARCHITECTURES[config_dict["architectures"][0]]
    for module, name in CODE_FILES[kind]:
        shutil.copyfile(module.__file__, tmp / name)


def is_export_dir(path: Path) -> bool:
    """Whether ``path`` is one of our exports: config.json naming DFlashDraftModel, the
    weights and dflash.py, and no file we do not write ourselves."""
    names = {p.name for p in path.iterdir()}
    if not {CONFIG_NAME, WEIGHTS_NAME} <= names or not names <= set(EXPORT_FILES):
        return False
    try:
        config = json.loads((path / CONFIG_NAME).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("architectures") in [[a] for a in ARCHITECTURES]


def check_export_destination(out_dir: str | Path, prog: str = "dflash-export") -> None:
    """Raise ValueError unless ``out_dir`` may receive an export: absent, an empty folder or
    a previous export (which is then replaced). Anything else belongs to the user."""
    from dflash_train.errors import check_own_folder, check_writable_dir

    check_own_folder(out_dir, "export directory", prog, EXPORT_FILES, is_export_dir)
    check_writable_dir(out_dir, "export directory")


def check_target_weights(config, digest: str, override: str) -> None:
    """Refuse a drafter exported for other target weights than ``digest`` (a target's
    ``weights_digest``): a model of the same architecture passes every shape check and then
    rejects nearly every draft. ``override`` names the setting that allows it on purpose.
    A hub id that was never downloaded has no content digest to compare."""
    recorded = getattr(config, TARGET_WEIGHTS_KEY, None)
    if recorded and recorded != digest and not (recorded.startswith("hub-") or digest.startswith("hub-")):
        raise ValueError(f"the drafter was trained for the target weights {recorded}, this target's are {digest}: "
                         f"it would draft for another model; use the drafter's own target, or set {override} "
                         "if this is intended")


def save_drafter(model: DFlashDraftModel, out_dir, extra_files: dict | None = None, state_dict=None,
                 target_weights: str | None = None, prog: str = "dflash-export") -> Path:
    """Export a drafter (or a gathered `state_dict` for its config) in the contract format.

    extra_files: {name: text} written beside (a README model card, a recipe, a manifest).
    target_weights: the trained-for target's weights digest, recorded for check_target_weights.
    """
    state = state_dict if state_dict is not None else model.state_dict()
    state = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    if kind_of(model.config) == "dflash2":  # what the training forward multiplied by, in the weights
        state = dflash2.fold_conv_delta_scale(state, dflash2.conv_delta_scale(model.config))
    dspark = is_dspark(model.config)
    config_dict = dspark_export_config(model.config) if dspark else export_config(model.config)
    if target_weights:
        config_dict[TARGET_WEIGHTS_KEY] = target_weights
    # The names and shapes the exported config implies, from a weightless (meta) model:
    # a real one would allocate and initialise a full drafter just to be compared.
    written = config_class(config_dict)(**_config_fields(config_dict))
    conflicts = serving_conflicts(written)  # a drafter vLLM or SGLang would run otherwise is not exported
    if conflicts:
        raise ValueError(f"{out_dir}: " + "; ".join(conflicts))
    with torch.device("meta"):
        expected = new_drafter(written).state_dict()
    check_weights(state, expected, out_dir)
    check_finite(state, out_dir)

    def write(tmp: Path):
        _write_export(state, config_dict, tmp)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)

    # A crash leaves the previous export or the new one, never a half-written one.
    check_export_destination(out_dir, prog)
    return atomic_write(out_dir, write, folder=True)


def _config_fields(config_dict: dict) -> dict:
    return {k: v for k, v in config_dict.items() if k not in _NOT_CONFIG_FIELDS}


def read_config(path) -> DFlashConfig:
    """Parse and check an export's config.json without touching the weights."""
    raw = read_raw_config(Path(path))
    file = Path(path) / CONFIG_NAME
    dspark = raw.get("architectures") == [DSPARK_ARCHITECTURE]
    missing = [k for k in (DSPARK_REQUIRED_KEYS if dspark else REQUIRED_KEYS) if k not in raw]
    if missing:
        raise ValueError(f"{file}: missing required key(s) {missing}")
    nested = raw["dflash_config"]
    for key in ("mask_token_id", "target_layer_ids"):
        if key not in nested:
            raise ValueError(f"{file}: missing required key dflash_config.{key}")
    if dspark:
        for key in ("mask_token_id", "target_layer_ids"):
            if raw[key] != nested[key]:
                raise ValueError(f"{file}: {key}={raw[key]!r} but dflash_config.{key}={nested[key]!r}; "
                                 "the serving engines read the top-level one, our runtime the nested one")
    config = config_class(raw)(**_config_fields(raw))
    validate_config(config)
    return config


def validate_config(config) -> None:
    """Checks of a drafter config on its own: ids in range of what it claims to serve."""
    layer_ids = list(dflash_field(config, "target_layer_ids"))
    n_target = config.num_target_layers
    bad = [i for i in layer_ids if not 0 <= int(i) < n_target]
    if bad:
        raise ValueError(f"target_layer_ids={layer_ids} but num_target_layers is {n_target}: {bad} out of range")
    mask_id = dflash_field(config, "mask_token_id")
    if mask_id is None or not 0 <= int(mask_id) < config.vocab_size:
        raise ValueError(f"mask_token_id={mask_id} is outside the vocabulary (0..{config.vocab_size - 1})")
    if block_size_of(config) < 2:
        raise ValueError(f"block_size={dflash_field(config, 'block_size')} must be at least 2")
    if kind_of(config) == "dflash2":
        dflash2.check_dflash2(config)
        stray = [k for k in dflash2.TRAINING_ONLY if hasattr(config, k)]
        if stray:  # our runtime would apply it, SGLang and vLLM would not
            raise ValueError(f"{stray[0]}={getattr(config, stray[0])!r} is a training setting, folded into the "
                             "weights at export; a drafter's config.json does not carry it")
    conflicts = serving_conflicts(config)
    if conflicts:
        raise ValueError("; ".join(conflicts))


def validate_against_target(config, target) -> None:
    """A drafter serves exactly one target: its geometry, vocabulary and layer ids must match."""
    checks = [
        ("hidden_size", config.hidden_size, target.hidden_size),
        ("num_target_layers", config.num_target_layers, target.num_layers),
    ]
    for name, mine, theirs in checks:
        if mine != theirs:
            raise ValueError(f"drafter {name}={mine} but the target has {theirs}: this drafter is for another target")
    layer_ids = list(dflash_field(config, "target_layer_ids"))
    bad = [i for i in layer_ids if not 0 <= i < target.num_layers]
    if bad:
        raise ValueError(f"target_layer_ids={layer_ids} but the target has {target.num_layers} layers")
    mask_id = int(dflash_field(config, "mask_token_id"))
    if not 0 <= mask_id < target.vocab_rows:
        raise ValueError(f"mask_token_id={mask_id} but the target's embedding has {target.vocab_rows} rows")
    if config.vocab_size != target.vocab_rows and config.vocab_size != target.config.vocab_size:
        raise ValueError(f"drafter vocab_size={config.vocab_size} but the target has {target.vocab_rows} tokens")


def check_weights(state: dict, expected: dict, where) -> None:
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{where}: weights do not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    wrong = [(k, tuple(state[k].shape), tuple(v.shape)) for k, v in expected.items() if state[k].shape != v.shape]
    if wrong:
        raise ValueError(f"{where}: weight shapes do not match the config (name, found, expected): {wrong[:3]}")


def check_finite(state: dict, where) -> None:
    """A NaN or inf weight makes every draft garbage while a runtime still loads it."""
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{where}: tensor {name!r} has non-finite values (NaN or inf): "
                             "the drafter is broken (a diverged run or a damaged checkpoint)")


def load_drafter(path, target=None, dtype: torch.dtype | None = None, device="cpu") -> DFlashDraftModel:
    """Load an export (safetensors only, never pickle), validated against `target` if given.
    A drafter from another trainer (z-lab, SpecForge, Model-Optimizer, speculators) is mapped
    onto ours on the way in (model/foreign.py)."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"drafter path {str(path)!r} is not a directory")
    dspark = read_raw_config(path).get("architectures") == [DSPARK_ARCHITECTURE]
    mapped = None if dspark else read_foreign(path, None if target is None else target.num_layers)
    if mapped is not None:
        validate_config(mapped.config)
    config = read_config(path) if mapped is None else mapped.config
    if target is not None:
        validate_against_target(config, target)
    file = path / WEIGHTS_NAME
    state = read_weights(path) if mapped is None else mapped.state
    model = new_drafter(config)
    check_weights(state, model.state_dict(), file)
    check_finite(state, file)
    model.load_state_dict(state, strict=True)
    model = model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
    return model.eval()
