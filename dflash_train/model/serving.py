"""The config.json keys vLLM and SGLang read, stated so that they run a drafter as we do.

A serving engine that misses a key falls back to a default silently, and a drafter served
with the wrong target layers, attention kind or window is simply never accepted. So an
export states every key the two readers look up (tests/unit/test_serving_keys.py reads our
exports the way each of them does, citing the source files and commits), and a config that
states one of them against our runtime is refused when it is loaded.

key                                 read by                     value
dflash_config.target_layer_ids      vLLM, SGLang, `dflash`      decoder layer i's output; vLLM and SGLang
                                                                capture the input of layer i + 1 (the same)
eagle_aux_hidden_state_layer_ids    vLLM                        never written: vLLM would capture those
                                                                layers' inputs as given, without the + 1
dflash_config.mask_token_id         vLLM, SGLang, `dflash`
block_size, num_target_layers       SGLang, `dflash`            (vLLM: num_speculative_tokens = B - 1)
layer_types                         vLLM, SGLang, `dflash`      one per draft layer
sliding_window                      vLLM, SGLang, `dflash`      keys a sliding layer sees, its own included
dflash_config.use_swa               vLLM                        whether any layer slides (true on an all-full
                                                                `layer_types` would make every layer slide)
dflash_config.swa_window_size       vLLM (before sliding_window) = sliding_window, when a layer slides
dflash_config.causal, is_causal     vLLM (is_causal first),     false when every layer is full attention, true
                                    SGLang and `dflash`         when every layer slides; absent when mixed (a
                                    (is_causal)                 value applies to every layer, and the readers'
                                                                per-layer default is ours: causal iff sliding)
target_hidden_size                  vLLM                        the target's hidden size (fc input / features)
rope_is_neox_style                  SGLang                      true: our RoPE rotates halves (rotate_half)
is_neox_style                       vLLM (SGLang's fallback)    true
draft_vocab_size                    vLLM                        = vocab_size: no draft-to-target token map
"""

from __future__ import annotations

from dflash_train.model.dflash import FULL_ATTENTION, SLIDING_ATTENTION, dflash_field

VLLM_AUX_LAYERS = "eagle_aux_hidden_state_layer_ids"
# vLLM and SGLang capture the hidden state entering decoder layer c: layer i's output is
# captured at c = i + 1, which is what they add to target_layer_ids.
CAPTURE_OFFSET = 1
NEOX_KEYS = ("rope_is_neox_style", "is_neox_style")


def layer_types(config) -> list[str]:
    """Each draft layer's attention kind, as the drafter builds its layers."""
    return list(getattr(config, "layer_types", None) or [FULL_ATTENTION] * config.num_hidden_layers)


def block_causal(config) -> bool | None:
    """The one causal flag that describes every layer: False when all are full attention
    (bidirectional inside the block), True when all slide, None when they are mixed."""
    kinds = set(layer_types(config))
    if kinds == {FULL_ATTENTION}:
        return False
    if kinds == {SLIDING_ATTENTION}:
        return True
    return None


def serving_fields(config) -> tuple[dict, dict]:
    """(top-level keys, dflash_config keys) that an export writes for the serving engines."""
    sliding = SLIDING_ATTENTION in layer_types(config)
    top = {
        "target_hidden_size": int(config.hidden_size),
        "draft_vocab_size": int(config.vocab_size),
        **{key: True for key in NEOX_KEYS},
    }
    nested = {"use_swa": sliding}
    if sliding:
        nested["swa_window_size"] = config.sliding_window  # null is refused by serving_conflicts
    causal = block_causal(config)
    if causal is not None:
        top["is_causal"] = nested["causal"] = causal
    return top, nested


def serving_conflicts(config) -> list[str]:
    """The serving keys of a loaded config that contradict how our runtime runs it."""
    kinds = layer_types(config)
    sliding = SLIDING_ATTENTION in kinds
    window = getattr(config, "sliding_window", None)
    if len(kinds) != config.num_hidden_layers:
        return [f"layer_types has {len(kinds)} entries but the drafter has {config.num_hidden_layers} layers"]
    if sliding and window is None:
        return [f"layer_types={kinds} has sliding layers but sliding_window is null"]
    problems = []
    stated = {
        "dflash_config.causal": dflash_nested(config, "causal"),
        "is_causal": getattr(config, "is_causal", None),
        "dflash_config.use_swa": dflash_nested(config, "use_swa"),
        "dflash_config.swa_window_size": dflash_nested(config, "swa_window_size") if sliding else None,
        "target_hidden_size": getattr(config, "target_hidden_size", None),
        "draft_vocab_size": getattr(config, "draft_vocab_size", None),
        **{key: getattr(config, key, None) for key in NEOX_KEYS},
    }
    ours = {
        "dflash_config.causal": block_causal(config),
        "is_causal": block_causal(config),
        "dflash_config.use_swa": sliding,
        "dflash_config.swa_window_size": window,
        "target_hidden_size": config.hidden_size,
        "draft_vocab_size": config.vocab_size,
        **{key: True for key in NEOX_KEYS},
    }
    for key, value in stated.items():
        if value is not None and value != ours[key]:
            runs_as = "each layer on its own (causal iff sliding)" if ours[key] is None else repr(ours[key])
            problems.append(f"{key}={value!r} but the drafter runs as {runs_as} (layer_types={kinds}, "
                            f"sliding_window={window}): a serving engine would run it differently")
    aux = getattr(config, VLLM_AUX_LAYERS, None)
    expected_aux = [int(i) + CAPTURE_OFFSET for i in dflash_field(config, "target_layer_ids")]
    if aux is not None and list(aux) != expected_aux:
        problems.append(f"{VLLM_AUX_LAYERS}={list(aux)} but target_layer_ids plus one is {expected_aux}: "
                        "vLLM would feed the drafter other target layers than it was trained on")
    return problems


def dflash_nested(config, name: str):
    """A key of the config's `dflash_config` only (no top-level fallback)."""
    return (getattr(config, "dflash_config", None) or {}).get(name)
