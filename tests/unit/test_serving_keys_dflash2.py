"""A DFlash2 export (drafter.kind=dflash2) read the way SGLang and vLLM read DFlash2
drafters, and read back by our own loader with the same drafts.

Each reader is written down from its source (the lookups, defaults and weight shapes only),
over transformers' AutoConfig of the export directory, as tests/unit/test_serving_keys.py
does for DFlash (whose readers also apply here: a DFlash2 drafter is a DFlash backbone):

SGLang, github.com/sgl-project/sglang:
  python/sglang/srt/speculative/dflash_utils.py @ 00731f0bc9fa81c39802754fb4b62e9cce967582
    `parse_dflash_draft_config`: conv_kernel_size, conv_group_size, selector_rank and
    selector_top_k from `dflash_config` only (default 0 = off; each pair both or neither),
    output_multiplier from dflash_config (default 1.0, must be > 0), final_logit_softcapping
    (0 or null = off), block_size from dflash_config first, then the top level
  python/sglang/srt/models/dflash.py after PR #35371: `DFlash2DraftModel` in EntryClass;
    base_kernel (2, taps, H), kernel_projection (2 * taps * H / G, H), raw codebook tensors
vLLM, github.com/vllm-project/vllm (PR #52816):
  vllm/model_executor/models/qwen3_dflash2.py @ 030da624231c394ea975df15248edd9adc9315da
    `DFlash2Qwen3DecoderLayer`: config.dflash_config["conv_kernel_size"], ["conv_group_size"]
    (KeyError when absent), the convolution's block = 1 + num_speculative_tokens;
    `DFlash2Qwen3Model`: ["selector_rank"], ["selector_top_k"], input_embedding_scale
    (default 1.0); `DFlash2Qwen3ForCausalLM`: output_multiplier (default 1.0),
    final_logit_softcapping (0 or null = off); `DFlashGroupedConv`, `CandidateSelector`
    parameter shapes
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModel

from dflash_train.model.dflash import ContextCache, Sampling, target_features
from dflash_train.model.dflash2 import DFlash2Config, DFlash2DraftModel
from dflash_train.model.io import load_drafter, save_drafter
from tests.conftest import make_tiny_target
from tests.unit.test_export import copy_export
from tests.unit.test_serving_keys import sglang_reads, vllm_reads

MASK_ID, BLOCK = 96, 4
KC, G, RANK, TOP_K = 2, 16, 8, 4  # not the public values, so a reader's default cannot pass for ours


def sglang_dflash2_reads(config) -> dict:
    nested = dict(getattr(config, "dflash_config", None) or {})
    conv_k, conv_g = int(nested.get("conv_kernel_size", 0)), int(nested.get("conv_group_size", 0))
    assert bool(conv_k) == bool(conv_g), "SGLang raises: conv_kernel_size and conv_group_size together"
    rank, top_k = int(nested.get("selector_rank", 0)), int(nested.get("selector_top_k", 0))
    assert bool(rank) == bool(top_k), "SGLang raises: selector rank and top_k together"
    multiplier = float(nested.get("output_multiplier", 1.0))
    assert multiplier > 0, "SGLang raises: output_multiplier must be positive"
    softcap = float(nested.get("final_logit_softcapping") or 0.0)
    block = nested.get("block_size", getattr(config, "block_size", None))
    return {"architecture": config.architectures[0], "conv": (conv_k, conv_g), "selector": (rank, top_k),
            "output_multiplier": multiplier, "softcap": softcap if softcap > 0 else None,
            "block_size": 16 if block is None else int(block)}


def vllm_dflash2_reads(config, num_speculative_tokens: int) -> dict:
    nested = config.dflash_config
    softcap = float(nested.get("final_logit_softcapping") or 0.0)
    return {"architecture": config.architectures[0],
            "conv": (int(nested["conv_kernel_size"]), int(nested["conv_group_size"])),
            "selector": (int(nested["selector_rank"]), int(nested["selector_top_k"])),
            "conv_block": 1 + num_speculative_tokens,
            "input_embedding_scale": float(nested.get("input_embedding_scale", 1.0)),
            "output_multiplier": float(nested.get("output_multiplier", 1.0)),
            "softcap": softcap if softcap > 0 else None}


def expected_dflash2_weights(config, reads: dict) -> dict:
    """The DFlash2 tensors both engines allocate, by name, from what they read."""
    taps, group = reads["conv"]
    rank, _ = reads["selector"]
    hidden, vocab = config.hidden_size, config.vocab_size
    out = {"candidate_selector.hidden_projection.weight": (rank, hidden),
           "candidate_selector.predecessor_codebook": (vocab, rank),
           "candidate_selector.successor_codebook": (vocab, rank)}
    for i in range(config.num_hidden_layers):
        for conv in ("attention_conv", "mlp_conv"):
            out[f"layers.{i}.{conv}.base_kernel"] = (2, taps, hidden)
            out[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * taps * hidden // group, hidden)
    return out


@pytest.fixture(scope="module")
def target():
    return make_tiny_target("qwen3")


@pytest.fixture(scope="module")
def export(target, tmp_path_factory):
    cfg = DFlash2Config.from_target(target.config, mask_token_id=MASK_ID, num_hidden_layers=2, block_size=BLOCK,
                                    conv_kernel_size=KC, conv_group_size=G, selector_rank=RANK, selector_top_k=TOP_K)
    torch.manual_seed(4)
    drafter = DFlash2DraftModel(cfg).eval()
    with torch.no_grad():  # trained-looking values: the fresh ones are the identity and zeros
        for name, p in drafter.named_parameters():
            if "conv" in name or "selector" in name:
                p.normal_(0, 0.3)
    return drafter, save_drafter(drafter, tmp_path_factory.mktemp("dflash2") / "drafter")


def test_both_readers_build_our_dflash2(export, target):
    drafter, out = export
    config = AutoConfig.from_pretrained(out)
    sglang, vllm = sglang_dflash2_reads(config), vllm_dflash2_reads(config, num_speculative_tokens=BLOCK - 1)
    for reader in (sglang, vllm):
        assert reader["architecture"] == "DFlash2DraftModel"
        assert reader["conv"] == (KC, G) and reader["selector"] == (RANK, TOP_K)
        assert reader["output_multiplier"] == 1.0 and reader["softcap"] is None  # our runtime applies neither
    assert vllm["input_embedding_scale"] == 1.0
    assert sglang["block_size"] == vllm["conv_block"] == drafter.block_size == BLOCK  # the convolution's block
    # the DFlash part reads as it does for a DFlash drafter
    for reader in (vllm_reads(config), sglang_reads(config)):
        assert reader["mask_token_id"] == MASK_ID and reader["capture"] == [i + 1 for i in drafter.target_layer_ids]
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["DFlash2DraftModel"]
    assert not {"conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"} & set(raw)  # nested only
    assert not {"output_multiplier", "final_logit_softcapping", "input_embedding_scale"} & set(raw["dflash_config"])


def test_every_exported_weight_has_the_shape_the_readers_allocate(export):
    drafter, out = export
    config = AutoConfig.from_pretrained(out)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    for reads in (sglang_dflash2_reads(config), vllm_dflash2_reads(config, BLOCK - 1)):
        for name, shape in expected_dflash2_weights(config, reads).items():
            assert shapes[name] == shape, name
    assert not [k for k in shapes if "embed_tokens" in k or "lm_head" in k or k.endswith("codebook.weight")]
    assert set(shapes) == set(drafter.state_dict())


def test_keys_at_the_top_level_only_are_refused(export, tmp_path):
    # SGLang reads the DFlash2 keys in dflash_config only: there it would serve plain DFlash.
    _, out = export

    def hoist(cfg):
        for key in ("conv_kernel_size", "conv_group_size"):
            cfg[key] = cfg["dflash_config"].pop(key)

    moved = copy_export(out, tmp_path / "moved", hoist)
    assert sglang_dflash2_reads(AutoConfig.from_pretrained(moved))["conv"] == (0, 0)
    with pytest.raises(ValueError, match="needs dflash_config.conv_kernel_size"):
        load_drafter(moved)


def test_a_setting_we_do_not_implement_is_refused(export, tmp_path):
    _, out = export
    capped = copy_export(out, tmp_path / "capped", lambda c: c["dflash_config"].update(final_logit_softcapping=20.0))
    with pytest.raises(ValueError, match=r"final_logit_softcapping=20.0 is not implemented"):
        load_drafter(capped)


def test_round_trip_drafts_equal(export, target):
    drafter, out = export
    loaded = load_drafter(out)
    assert isinstance(loaded, DFlash2DraftModel)
    for k, v in drafter.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    remote = AutoModel.from_pretrained(str(out), trust_remote_code=True).eval()  # the dflash2.py beside the weights
    assert type(remote).__name__ == "DFlash2DraftModel"
    ids = torch.randint(0, 90, (1, 7), generator=torch.Generator().manual_seed(2))
    runs = [m.spec_generate(target, ids, 20, return_stats=True) for m in (drafter, loaded, remote)]
    for run in runs[1:]:
        assert torch.equal(run.output_ids, runs[0].output_ids)
        assert run.acceptance_lengths == runs[0].acceptance_lengths
    assert torch.equal(runs[0].output_ids, target.generate(ids, max_new_tokens=20, do_sample=False))
    # the drafts themselves, greedy and sampled (a random drafter's are all rejected above)
    with torch.inference_mode():
        feats = target_features(target(ids, output_hidden_states=True).hidden_states, drafter.target_layer_ids)
    block = torch.full((1, BLOCK), MASK_ID)
    block[0, 0] = 42
    for sampling in (Sampling(), Sampling(temperature=0.8)):
        proposals = [m.propose(target, 42, BLOCK - 1, BLOCK, feats, 7, ContextCache(), MASK_ID, sampling,
                               torch.Generator().manual_seed(5)) for m in (drafter, loaded, remote)]
        for drafts, probs in proposals[1:]:
            assert torch.equal(drafts, proposals[0][0])
            assert (probs is None) == sampling.greedy
            if probs is not None:
                # the same weights and source; under transformers 5.24 the folder loaded with
                # trust_remote_code rounds 8 of the sampled probabilities one float32 step (6e-8) apart
                torch.testing.assert_close(probs, proposals[0][1], rtol=0, atol=2e-7)
                assert torch.equal(probs > 0, proposals[0][1] > 0)  # the same candidates carry mass


TF457_SCRIPT = """
import sys, torch, transformers
from safetensors.torch import load_file
from transformers import AutoModel, AutoModelForCausalLM
assert transformers.__version__.startswith("4.57"), transformers.__version__
out, target_dir, io_file = sys.argv[1:]
model = AutoModel.from_pretrained(out, trust_remote_code=True).eval()
target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
t = load_file(io_file)
with torch.no_grad():
    got = model(noise_embedding=t["noise"], target_hidden=t["ctx"], position_ids=t["positions"])
print("maxdiff", float((got - t["expected"]).abs().max()))
spec = model.spec_generate(input_ids=t["ids"], max_new_tokens=20, temperature=0.0, target=target, stop_token_ids=None)
print("lossless", bool(torch.equal(spec, target.generate(t["ids"], max_new_tokens=20, do_sample=False))))
"""


def test_export_loads_and_drafts_under_transformers_457(export, target, tmp_path):
    """The dflash2.py and dflash.py beside the weights, under the transformers version
    published DFlash model cards pin."""
    import subprocess

    from safetensors.torch import save_file

    from tests.unit.test_export import TF457_PYTHON

    assert TF457_PYTHON.exists(), f"{TF457_PYTHON} missing: run `make setup` (it builds the transformers 4.57 venv)"
    drafter, out = export
    target.save_pretrained(tmp_path / "target")
    g = torch.Generator().manual_seed(0)
    noise, ctx = torch.randn(1, BLOCK, 64, generator=g), torch.randn(1, 7, 128, generator=g)
    positions = (torch.arange(7 + BLOCK) + 3)[None]
    with torch.no_grad():
        expected = drafter(noise, ctx, positions)
    ids = torch.randint(0, 90, (1, 9), generator=torch.Generator().manual_seed(7))
    save_file({"noise": noise, "ctx": ctx, "positions": positions, "expected": expected, "ids": ids},
              str(tmp_path / "io.safetensors"))
    run = subprocess.run([str(TF457_PYTHON), "-c", TF457_SCRIPT, str(out), str(tmp_path / "target"),
                          str(tmp_path / "io.safetensors")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = dict(line.split() for line in run.stdout.splitlines() if line.startswith(("maxdiff", "lossless")))
    assert float(lines["maxdiff"]) < 1e-5 and lines["lossless"] == "True"
