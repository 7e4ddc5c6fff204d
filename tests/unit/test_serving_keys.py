"""Our exports read the way vLLM and SGLang read them: the same target layers, mask token,
block size, attention kind and window as our own runtime uses (issue 28, item 4).

Each reader is written down here from its source (our own code, the lookups and defaults
only), over the config object both engines build: transformers' AutoConfig of the export
directory (a Qwen3Config, model_type "qwen3"), so transformers' own normalisation (a
`sliding_window` nulled without `use_sliding_window`) is part of what is checked.

vLLM, github.com/vllm-project/vllm:
  vllm/model_executor/models/qwen3_dflash.py @ 036a00d1f5d00d449d02dce9babdd15a5b4d06c9
    `_dflash_layer_causal`, `_resolve_layer_attention`, `DFlashQwen3DecoderLayer` (is_neox_style),
    `DFlashQwen3Model` (mask_token_id), `DFlashQwen3ForCausalLM` (draft_vocab_size),
    `_get_dflash_fc_input_size` (target_hidden_size)
  vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py @ 0cfdd2e15d6991f354c6e22fd7f7e7577afe0424
    `get_eagle3_aux_layers_from_config`: eagle_aux_hidden_state_layer_ids, else target_layer_ids + 1;
    the target model captures the hidden state entering decoder layer c for each aux id c
  vllm/v1/attention/backends/flash_attn.py: a causal layer with sliding_window W looks W - 1 keys back
  The block size is not in the config: it is num_speculative_tokens + 1 from the serving command.
SGLang, github.com/sgl-project/sglang:
  python/sglang/srt/speculative/dflash_utils.py @ 00731f0bc9fa81c39802754fb4b62e9cce967582
    `parse_dflash_draft_config` (dflash_config first, then the top level; block size 16 when absent),
    `get_dflash_layer_types`, `get_dflash_attention_sliding_window_size` (window_left = W - 1)
  python/sglang/srt/models/dflash.py @ 003b23d7388eabdfbfecd2610c7e228f9f6a2734
    `_get_dflash_layer_attention_params` (no layer_types or full: ENCODER_ONLY; sliding: DECODER),
    rope_is_neox_style, else is_neox_style, else True; later versions of the file let a config's
    `is_causal` override those defaults, which is modelled too
  python/sglang/srt/models/qwen3.py @ d4ff9a85f96cbebd29fbe07785606bb03e8def8d
    `set_dflash_layers_to_capture`: captures before layer id + 1
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from dflash_train.model.dflash import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    DFlashConfig,
    DFlashDraftModel,
    RotaryEmbedding,
    apply_rope,
    target_features,
)
from dflash_train.model.io import load_drafter, save_drafter
from dflash_train.model.runtime import _slot_draft_masks
from tests.conftest import make_tiny_target
from tests.unit.test_export import copy_export

MASK_ID, BLOCK, WINDOW = 96, 4, 3  # a block size other than the readers' default 16
DRAFTERS = {
    "plain": {},
    "mixed": dict(layer_types=[SLIDING_ATTENTION, FULL_ATTENTION], use_sliding_window=True, sliding_window=WINDOW),
    "sliding": dict(layer_types=[SLIDING_ATTENTION] * 2, use_sliding_window=True, sliding_window=WINDOW),
}
SERVING_ONLY = ("is_causal", "target_hidden_size", "draft_vocab_size", "rope_is_neox_style", "is_neox_style")


def vllm_reads(config) -> dict:
    dflash = dict(getattr(config, "dflash_config", None) or {})
    capture = getattr(config, "eagle_aux_hidden_state_layer_ids", None)
    if not capture:
        capture = [i + 1 for i in dflash.get("target_layer_ids") or []]
    types = getattr(config, "layer_types", None)
    use_swa = dflash.get("use_swa", False)
    any_sliding = types is not None and SLIDING_ATTENTION in types
    layers = []
    for i in range(config.num_hidden_layers):
        sliding = use_swa if types is None or (use_swa and not any_sliding) else types[i] == SLIDING_ATTENTION
        window = dflash.get("swa_window_size", getattr(config, "sliding_window", None)) if sliding else None
        if getattr(config, "is_causal", None) is not None:
            causal = bool(config.is_causal)
        elif dflash.get("causal") is not None:
            causal = bool(dflash["causal"])
        else:
            causal = bool(types) and types[i] == SLIDING_ATTENTION
        layers.append((causal, window))  # W keys seen, the query's own included (W - 1 back)
    target_hidden = getattr(config, "target_hidden_size", None) or config.hidden_size
    return {"capture": list(capture), "mask_token_id": dflash.get("mask_token_id", getattr(config, "mask_token_id", None)),
            "layers": layers, "neox": getattr(config, "is_neox_style", True),
            "draft_vocab": getattr(config, "draft_vocab_size", None) or config.vocab_size,
            "fc_in": target_hidden * len(capture)}


def sglang_reads(config) -> dict:
    dflash = dict(getattr(config, "dflash_config", None) or {})
    ids = dflash.get("target_layer_ids", getattr(config, "target_layer_ids", None))
    assert ids is not None, "SGLang would fall back to its own layer choice"
    block = dflash.get("block_size", getattr(config, "block_size", None))
    types = getattr(config, "layer_types", None)
    layers = []
    for i in range(config.num_hidden_layers):
        explicit = getattr(config, "is_causal", None)
        if types is None or types[i] == FULL_ATTENTION:
            layers.append((False if explicit is None else bool(explicit), None))
        else:
            assert types[i] == SLIDING_ATTENTION
            window = getattr(config, "sliding_window", None)
            assert window is not None, "SGLang raises: sliding layers need sliding_window"
            window_left = int(window) - 1  # SGLang's RadixAttention sliding_window_size: keys back
            layers.append((True if explicit is None else bool(explicit), window_left + 1))
    return {"capture": [i + 1 for i in ids], "block_size": 16 if block is None else int(block),
            "num_target_layers": dflash.get("num_target_layers", getattr(config, "num_target_layers", None)),
            "mask_token_id": dflash.get("mask_token_id", getattr(config, "mask_token_id", None)),
            "layers": layers,
            "neox": bool(getattr(config, "rope_is_neox_style", getattr(config, "is_neox_style", True))),
            "fc_in": len(ids) * config.hidden_size}


@pytest.fixture(scope="module")
def target():
    return make_tiny_target("qwen3")


def _export(name: str, target, folder):
    torch.manual_seed(4)
    cfg = DFlashConfig.from_target(target.config, mask_token_id=MASK_ID, num_hidden_layers=2, block_size=BLOCK,
                                   **DRAFTERS[name])
    drafter = DFlashDraftModel(cfg).eval()
    return name, drafter, save_drafter(drafter, folder / "drafter")


@pytest.fixture(scope="module", params=sorted(DRAFTERS))
def export(request, target, tmp_path_factory):
    return _export(request.param, target, tmp_path_factory.mktemp(request.param))


def _attention(mask, start: int, width: int) -> tuple[bool, int | None]:
    """(causal inside the block, keys seen) of one layer's (1, 1, B, ctx + B) mask; None: no window."""
    if mask is None:
        return False, None
    block, ctx = mask[0, 0, :, -width:], mask[0, 0, :, :start]
    tril = torch.ones(width, width, dtype=torch.bool).tril()
    assert block.all() or torch.equal(block & ~tril, torch.zeros_like(block))
    window = None if ctx.all() else int(mask[0, 0].sum(-1).max())
    return not bool(block.all()), window


def our_attention(drafter) -> list[tuple[bool, int | None]]:
    """Each layer's attention, from the masks the dynamic and the static runtime build."""
    start = 20  # past the window: every slot of a sliding layer sees a full window
    masks = drafter.inference_masks(start, BLOCK, "cpu")
    dynamic = [_attention(None if masks is None else masks[t], start, BLOCK) for t in drafter.layer_types]
    slots = torch.arange(64)
    static_masks = _slot_draft_masks(drafter, slots, (start + torch.arange(BLOCK))[None], torch.tensor(60))
    # the static masks span every cache slot: keep the context before the anchor and the block
    static = [_attention(torch.cat([static_masks[t][..., :start], static_masks[t][..., -BLOCK:]], -1), start, BLOCK)
              for t in drafter.layer_types]
    assert static == dynamic
    return dynamic


def captured_inputs(target, ids, capture: list[int]) -> torch.Tensor:
    """The hidden states entering decoder layers ``capture``, side by side: what the engines feed."""
    layers = target.model.layers
    assert all(0 < c < len(layers) for c in capture), f"no decoder layer to capture before: {capture}"
    seen = {}
    hooks = [layers[c].register_forward_pre_hook(
        lambda mod, args, kwargs, c=c: seen.__setitem__(c, args[0] if args else kwargs["hidden_states"]),
        with_kwargs=True) for c in capture]
    try:
        with torch.no_grad():
            target(ids)
    finally:
        for hook in hooks:
            hook.remove()
    return torch.cat([seen[c] for c in capture], dim=-1)


def test_both_readers_get_what_our_runtime_uses(export, target):
    name, drafter, out = export
    config = AutoConfig.from_pretrained(out)
    vllm, sglang = vllm_reads(config), sglang_reads(config)
    ids = torch.randint(0, 90, (1, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = target_features(target(ids, output_hidden_states=True).hidden_states, drafter.target_layer_ids)
    for reader in (vllm, sglang):
        assert torch.equal(captured_inputs(target, ids, reader["capture"]), ours)
        assert reader["mask_token_id"] == drafter.mask_token_id == MASK_ID
        assert reader["layers"] == our_attention(drafter)
        assert reader["neox"] is True
        assert reader["fc_in"] == drafter.fc.in_features
    assert sglang["block_size"] == drafter.block_size == BLOCK
    assert sglang["num_target_layers"] == target.config.num_hidden_layers
    assert vllm["draft_vocab"] == target.config.vocab_size  # vLLM adds no draft-to-target token map
    expected = {"plain": [(False, None)] * 2, "mixed": [(True, WINDOW), (False, None)],
                "sliding": [(True, WINDOW)] * 2}[name]
    assert our_attention(drafter) == expected


def test_our_rope_is_the_neox_layout():
    # neox style rotates dimension j with j + d/2 (our rotate_half); the GPT-J layout pairs 2j and 2j+1
    config = DFlashConfig(hidden_size=32, num_attention_heads=2, head_dim=16, num_hidden_layers=1)
    cos, sin = RotaryEmbedding(config)(torch.tensor([[3]]), torch.float32)
    x = torch.zeros(1, 1, 1, 16)
    x[..., 0] = 1.0
    moved = apply_rope(x, cos, sin)[0, 0, 0].abs() > 1e-6
    assert moved.nonzero().flatten().tolist() == [0, 8]


def test_an_export_without_the_serving_keys_reads_the_same(export, tmp_path):
    """Exports written before these keys: still loaded by us, and the readers' defaults
    for them are what our runtime does."""
    _, drafter, out = export

    def strip(cfg):
        for key in SERVING_ONLY:
            cfg.pop(key, None)  # is_causal: absent on a mixed drafter
        for key in ("causal", "use_swa", "swa_window_size"):
            cfg["dflash_config"].pop(key, None)

    old = copy_export(out, tmp_path / "old", strip)
    assert isinstance(load_drafter(old), DFlashDraftModel)
    new_config, old_config = AutoConfig.from_pretrained(out), AutoConfig.from_pretrained(old)
    assert vllm_reads(old_config) == vllm_reads(new_config)
    assert sglang_reads(old_config) == sglang_reads(new_config)


@pytest.mark.parametrize("name,edit,message", [
    ("plain", lambda c: c["dflash_config"].update(causal=True), "dflash_config.causal=True but the drafter runs as False"),
    ("plain", lambda c: c.update(is_causal=True), "is_causal=True but the drafter runs as False"),
    ("plain", lambda c: c["dflash_config"].update(use_swa=True), "dflash_config.use_swa=True but the drafter runs as False"),
    ("plain", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 3]),
     r"eagle_aux_hidden_state_layer_ids=\[1, 3\] but target_layer_ids plus one is \[2, 4\]"),
    ("plain", lambda c: c.update(draft_vocab_size=64), "draft_vocab_size=64 but the drafter runs as 97"),
    ("plain", lambda c: c.update(target_hidden_size=128), "target_hidden_size=128 but the drafter runs as 64"),
    ("plain", lambda c: c.update(is_neox_style=False), "is_neox_style=False but the drafter runs as True"),
    ("mixed", lambda c: c["dflash_config"].update(causal=False),
     r"dflash_config.causal=False but the drafter runs as each layer on its own \(causal iff sliding\)"),
    ("mixed", lambda c: c["dflash_config"].update(swa_window_size=8),
     "dflash_config.swa_window_size=8 but the drafter runs as 3"),
    ("mixed", lambda c: c.update(sliding_window=None, use_sliding_window=False),
     "has sliding layers but sliding_window is null"),
])
def test_a_config_that_serves_differently_is_refused(target, tmp_path, name, edit, message):
    _, _, out = _export(name, target, tmp_path)
    with pytest.raises(ValueError, match=message):
        load_drafter(copy_export(out, tmp_path / "bad", edit))


def test_a_sliding_drafter_without_a_window_is_not_exported(target, tmp_path):
    # Qwen3Config nulls sliding_window unless use_sliding_window is set: the engines would
    # then refuse the drafter (both need a window for sliding layers), so the export does
    cfg = DFlashConfig.from_target(target.config, mask_token_id=MASK_ID, num_hidden_layers=2, block_size=BLOCK,
                                   layer_types=[SLIDING_ATTENTION, FULL_ATTENTION], sliding_window=WINDOW)
    assert cfg.sliding_window is None
    with pytest.raises(ValueError, match="has sliding layers but sliding_window is null"):
        save_drafter(DFlashDraftModel(cfg), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []
