"""Our DSpark export read the way SGLang and vLLM read DeepSpec's layout (docs/design/dspark-dflash2.md
sections 3.4 and 6), over the config object both build: transformers' AutoConfig of the export
directory (a Qwen3Config with the extra top-level keys as attributes).

SGLang, github.com/sgl-project/sglang @ 01f476234ab4ee99c7fb7cb31b68d31b6a7c54a8:
  python/sglang/srt/speculative/dspark_components/dspark_config.py `parse_dspark_draft_config`
    (markov_rank, markov_head_type and mask_token_id: dspark_* prefixed keys, then dspark_config,
    text_config, the top level; gamma and target_layer_ids from `parse_dflash_draft_config`,
    dflash_config first, then the top level; `speculators_model_type: dspark` is refused)
  python/sglang/srt/models/dspark.py `build_markov_head` (vanilla: markov_w1 Embedding(V, r),
    markov_w2 Linear(r, V)), `build_confidence_head` (built unless the ragged verify mode is
    static; with_markov defaults to markov_rank > 0; proj Linear(H + r, 1) with bias),
    `load_weights` (skips embed_tokens., lm_head., rotary_emb.)
vLLM, github.com/vllm-project/vllm:
  vllm/model_executor/models/qwen3_dspark.py @ 0302ff40439493d0db2e3bbfd509211703375d08
    `Qwen3DSparkModel` (config.markov_rank required; enable_confidence_head and
    confidence_head_with_markov default False; draft_vocab_size defaults to vocab_size),
    `Qwen3DSparkForCausalLM.load_weights` ("model." + name; lm_head and embed_tokens optional)
  vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py @ 0cfdd2e15d6991f354c6e22fd7f7e7577afe0424
    capture layers: eagle_aux_hidden_state_layer_ids, else dflash_config.target_layer_ids + 1
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from dflash_train.model.dspark import DSparkConfig, DSparkDraftModel
from dflash_train.model.io import load_drafter, save_drafter
from tests.conftest import make_tiny_target

MASK_ID, BLOCK, RANK = 96, 5, 8  # a block size other than SGLang's default 16 and DeepSpec's 7
SKIPPED_BY_SGLANG = ("embed_tokens.", "lm_head.", "rotary_emb.")


def _first(*values):
    return next((v for v in values if v is not None), None)


def sglang_reads(config) -> dict:
    dflash = dict(getattr(config, "dflash_config", None) or {})
    dspark = dict(getattr(config, "dspark_config", None) or {})
    text = getattr(config, "text_config", None) or config
    rank = _first(getattr(config, "dspark_markov_rank", None),
                  dspark.get("markov_rank", getattr(text, "markov_rank", getattr(config, "markov_rank", 0))))
    head_type = _first(getattr(config, "dspark_markov_head_type", None),
                       dspark.get("markov_head_type", getattr(text, "markov_head_type",
                                                              getattr(config, "markov_head_type", None))))
    base_mask = dflash.get("mask_token_id", getattr(config, "mask_token_id", None))
    mask = _first(getattr(config, "dspark_noise_token_id", None),
                  dspark.get("mask_token_id", getattr(text, "mask_token_id", getattr(config, "mask_token_id",
                                                                                      base_mask))))
    layer_ids = _first(getattr(config, "dspark_target_layer_ids", None),
                       dflash.get("target_layer_ids", getattr(config, "target_layer_ids", None)))
    gamma = _first(getattr(config, "dspark_block_size", None),
                   dflash.get("block_size", getattr(config, "block_size", 16)))
    rank = int(rank)
    with_markov = bool(getattr(config, "confidence_head_with_markov", rank > 0))
    return {"architecture": config.architectures[0], "gamma": int(gamma), "verify": int(gamma) + 1,
            "mask_token_id": int(mask), "capture": [int(i) + 1 for i in layer_ids], "markov_rank": rank,
            "markov_head_type": str(head_type).lower(),
            "refused_as_speculators": getattr(config, "speculators_model_type", None) == "dspark",
            "params": {"markov_head.markov_w1.weight": (config.vocab_size, rank),
                       "markov_head.markov_w2.weight": (config.vocab_size, rank),
                       "confidence_head.proj.weight": (1, config.hidden_size + (rank if with_markov else 0)),
                       "confidence_head.proj.bias": (1,)}}


def vllm_reads(config) -> dict:
    dflash = dict(getattr(config, "dflash_config", None) or {})
    capture = getattr(config, "eagle_aux_hidden_state_layer_ids", None) or [
        i + 1 for i in dflash.get("target_layer_ids") or []]
    rank = config.markov_rank  # an attribute: a config without it fails to build
    draft_vocab = getattr(config, "draft_vocab_size", None) or config.vocab_size
    params = {"model.markov_head.markov_w1.weight": (config.vocab_size, rank),
              "model.markov_head.markov_w2.weight": (draft_vocab, rank)}
    if getattr(config, "enable_confidence_head", False):
        with_markov = getattr(config, "confidence_head_with_markov", False)
        params["model.confidence_head.proj.weight"] = (1, config.hidden_size + (rank if with_markov else 0))
        params["model.confidence_head.proj.bias"] = (1,)
    return {"architecture": config.architectures[0], "capture": list(capture),
            "mask_token_id": dflash.get("mask_token_id", getattr(config, "mask_token_id", None)),
            "draft_vocab_size": draft_vocab, "sample_from_anchor": getattr(config, "sample_from_anchor", True),
            "params": params}


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    target = make_tiny_target("qwen3", layers=6, seed=5)
    cfg = DSparkConfig.from_target(target.config, mask_token_id=MASK_ID, num_hidden_layers=2, block_size=BLOCK,
                                   target_layer_ids=[1, 4], markov_rank=RANK)
    torch.manual_seed(6)
    drafter = DSparkDraftModel(cfg).eval()
    path = save_drafter(drafter, tmp_path_factory.mktemp("dspark") / "export")
    return {"target": target, "drafter": drafter, "path": path, "weights": load_file(str(path / "model.safetensors"))}


def test_sglang_reads_our_export_as_trained(export):
    reads = sglang_reads(AutoConfig.from_pretrained(export["path"]))
    drafter = export["drafter"]
    assert reads["architecture"] == "Qwen3DSparkModel"
    assert reads["gamma"] == drafter.drafts_per_block == BLOCK and reads["verify"] == BLOCK + 1
    assert reads["mask_token_id"] == MASK_ID < export["target"].config.vocab_size
    assert reads["capture"] == [i + 1 for i in drafter.target_layer_ids]
    assert reads["markov_rank"] == RANK > 0 and reads["markov_head_type"] == "vanilla"
    assert not reads["refused_as_speculators"]
    weights = export["weights"]
    # every exported weight loads: a head weight maps onto SGLang's head, the rest is the DFlash backbone
    heads = {k: tuple(v.shape) for k, v in weights.items() if k.startswith(("markov_head.", "confidence_head."))}
    assert heads == reads["params"]
    assert not [k for k in weights if k.startswith(SKIPPED_BY_SGLANG)]


def test_vllm_reads_our_export_as_trained(export):
    config = AutoConfig.from_pretrained(export["path"])
    reads = vllm_reads(config)
    drafter = export["drafter"]
    assert reads["architecture"] == "Qwen3DSparkModel"
    assert reads["capture"] == [i + 1 for i in drafter.target_layer_ids]
    assert reads["mask_token_id"] == MASK_ID
    assert reads["draft_vocab_size"] == config.vocab_size == export["target"].config.vocab_size
    assert reads["sample_from_anchor"] is True  # DeepSpec's slot convention, ours
    loaded = {"model." + k: tuple(v.shape) for k, v in export["weights"].items()
              if k.startswith(("markov_head.", "confidence_head."))}
    assert loaded == reads["params"]  # the confidence head is built, with the Markov input


def test_the_config_states_deepspecs_top_level_fields_and_no_speculators_marker(export):
    raw = json.loads((export["path"] / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3DSparkModel"] and raw["model_type"] == "qwen3"
    for key in ("num_anchors", "enable_confidence_head", "confidence_head_with_markov", "markov_rank",
                "markov_head_type", "mask_token_id", "target_layer_ids"):
        assert key in raw, key
    assert raw["enable_confidence_head"] is True and raw["confidence_head_with_markov"] is True
    assert raw["target_layer_ids"] == raw["dflash_config"]["target_layer_ids"] == [1, 4]
    assert "speculators_model_type" not in raw and "auto_map" not in raw
    assert sorted(p.name for p in export["path"].iterdir()) == ["config.json", "model.safetensors"]


def test_our_loader_reads_the_export_back_weight_for_weight(export):
    loaded = load_drafter(export["path"])
    assert isinstance(loaded, DSparkDraftModel) and loaded.config.markov_rank == RANK
    for name, value in export["drafter"].state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name


def test_a_top_level_field_that_contradicts_dflash_config_is_a_one_line_error(export, tmp_path):
    path = tmp_path / "edited"
    path.mkdir()
    raw = json.loads((export["path"] / "config.json").read_text())
    raw["mask_token_id"] = MASK_ID - 1
    (path / "config.json").write_text(json.dumps(raw))
    (path / "model.safetensors").write_bytes((export["path"] / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match=f"mask_token_id={MASK_ID - 1} but dflash_config.mask_token_id={MASK_ID}"):
        load_drafter(path)
