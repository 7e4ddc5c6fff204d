"""Drafters from other trainers (z-lab, SpecForge, Model-Optimizer, speculators) load into ours:
small checkpoints written in each trainer's layout give back the same tensors and the same
forward; what cannot be mapped is one line naming it; dflash-eval and dflash-train use them."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_train.model.dflash import DFlashConfig, DFlashDraftModel, rope_parameters
from dflash_train.model.files import read_raw_config
from dflash_train.model.foreign import detect_format, read_foreign
from dflash_train.model.io import load_drafter, save_drafter
from dflash_train.model.target import TargetModel
from dflash_train.training.trainer import Trainer
from tests.cli_helpers import assert_one_line_error, run_cli
from tests.conftest import make_tiny_target
from tests.foreign_formats import write_modelopt, write_specforge, write_speculators, write_zlab
from tests.train_data import tiny_inputs, tiny_train_config

ROPE = {"rope_type": "default", "rope_theta": 1e6}  # not the config classes' default: a dropped key shows


@pytest.fixture(scope="module")
def target():
    return make_tiny_target("qwen3", head_dim=16, rms_norm_eps=1e-6, rope_parameters=ROPE)


def random_drafter(target_config, seed=0, **kw) -> DFlashDraftModel:
    """Our drafter with every tensor distinct (norms too, which start as ones)."""
    kw = {"mask_token_id": 96, "num_hidden_layers": 2, "block_size": 4, **kw}
    torch.manual_seed(seed)
    drafter = DFlashDraftModel(DFlashConfig.from_target(target_config, **kw)).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return drafter


@pytest.fixture(scope="module")
def ours(target):
    return random_drafter(target.config)


def _inputs(cfg):
    g = torch.Generator().manual_seed(1)
    noise = torch.randn(1, 4, cfg.hidden_size, generator=g)  # (b, Q, H) one block
    ctx = torch.randn(1, 7, 2 * cfg.hidden_size, generator=g)  # (b, C, n*H)
    return noise, ctx, (torch.arange(11) + 5)[None]


def _write(fmt, root, drafter, target):
    if fmt == "z-lab":
        write_zlab(root, drafter)
        return root
    if fmt == "specforge":
        return write_specforge(root, drafter)
    if fmt == "modelopt":
        return write_modelopt(root, drafter)
    if fmt == "modelopt-raw":
        return write_modelopt(root, drafter, target=target)
    return write_speculators(root, drafter, target)


@pytest.mark.parametrize("fmt", ["z-lab", "specforge", "modelopt", "modelopt-raw", "speculators"])
def test_each_format_loads_the_same_weights_and_forward(fmt, tmp_path, target, ours, monkeypatch):
    path = _write(fmt, tmp_path / fmt, ours, target)
    assert detect_format(path, read_raw_config(path)) == fmt.removesuffix("-raw")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("a pickle was opened"))
    loaded = load_drafter(path, target=TargetModel(target))
    mine = ours.state_dict()
    assert set(loaded.state_dict()) == set(mine)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, mine[name]), name
    c = loaded.config
    assert (loaded.block_size, loaded.mask_token_id, loaded.target_layer_ids) == (4, 96, [1, 3])
    assert c.num_target_layers == 6 and rope_parameters(c)["rope_theta"] == 1e6 and c.head_dim == 16
    with torch.no_grad():
        torch.testing.assert_close(loaded(*_inputs(c)), ours(*_inputs(c)), rtol=0, atol=0)


def test_zlab_forward_matches_the_reference_runtime(tmp_path, target, ours):
    reference = write_zlab(tmp_path / "zlab", ours)
    loaded = load_drafter(tmp_path / "zlab", target=TargetModel(target))
    noise, ctx, positions = _inputs(loaded.config)
    with torch.no_grad():
        theirs = reference(position_ids=positions, noise_embedding=noise, target_hidden=ctx)
        torch.testing.assert_close(loaded(noise, ctx, positions), theirs, rtol=1e-5, atol=1e-5)


def test_speculators_needs_its_target_for_the_depth(tmp_path, target, ours):
    path = write_speculators(tmp_path / "spec", ours, target)
    with pytest.raises(ValueError, match="speculators checkpoint cannot be mapped without its target"):
        load_drafter(path)
    assert read_foreign(path, num_target_layers=6).config.num_target_layers == 6


def test_own_export_is_read_as_ours(tmp_path, ours):
    out = save_drafter(ours, tmp_path / "export")
    assert read_foreign(out) is None and detect_format(out, read_raw_config(out)) == "dflash-train"


def _drop_weight(path, name):
    state = load_file(str(path / "model.safetensors"))
    del state[name]
    save_file(state, str(path / "model.safetensors"))


def _edit(key, value=None, nested=False):
    def edit(raw):
        where = raw["dflash_config"] if nested else raw
        if value is None:
            where.pop(key)
        else:
            where[key] = value
    return edit


@pytest.mark.parametrize("fmt,edit,message", [
    ("modelopt", _edit("hidden_size"), "modelopt checkpoint cannot be mapped: missing hidden_size"),
    ("modelopt", _edit("mask_token_id", nested=True), "modelopt checkpoint cannot be mapped: missing "
                                                      "dflash_config.mask_token_id"),
    ("speculators", _edit("aux_hidden_state_layer_ids"), "speculators checkpoint cannot be mapped: missing "
                                                         "aux_hidden_state_layer_ids"),
    ("modelopt", _edit("causal", True, nested=True), "modelopt checkpoint sets dflash_config.causal=True"),
    ("modelopt", _edit("attention_sink_bias", True), "sets attention_sink_bias=True (learned attention sinks)"),
    ("z-lab", _edit("shift_label", True, nested=True), "specforge checkpoint sets dflash_config.shift_label=True"),
    ("modelopt", _edit("architectures", ["DFlash2DraftModel"]), "sets architectures=['DFlash2DraftModel']"),
    ("z-lab", _edit("output_multiplier", 2.0, nested=True), "dflash_config.output_multiplier=2.0 (scaled draft logits)"),
    ("z-lab", _edit("is_causal", True), "z-lab checkpoint sets is_causal=True"),
    ("modelopt", _edit("new_trick", 1, nested=True), "dflash_config.new_trick=1, a setting this loader does not know"),
    ("speculators", _edit("draft_vocab_size", 32), "draft_vocab_size=32 (a draft vocabulary smaller than the "
                                                   "target's 97)"),
    ("speculators", _edit("sample_from_anchor", True), "speculators checkpoint sets sample_from_anchor=True"),
    ("speculators", _edit("target_hidden_size", 128), "sets target_hidden_size=128 (target features of another width"),
    ("speculators", _edit("aux_hidden_state_layer_ids", [0, 2]), "aux_hidden_state_layer_ids=[0, 2]"),
])
def test_what_cannot_be_mapped_is_named(fmt, edit, message, tmp_path, target, ours):
    path = tmp_path / fmt
    if fmt == "z-lab":
        write_zlab(path, ours, config_edit=edit)
    elif fmt == "modelopt":
        write_modelopt(path, ours, config_edit=edit)
    else:
        write_speculators(path, ours, target, config_edit=edit)
    with pytest.raises(ValueError, match=None) as err:
        load_drafter(path, target=TargetModel(target))
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("fmt", ["z-lab", "modelopt", "speculators"])
def test_a_missing_weight_is_named(fmt, tmp_path, target, ours):
    path = _write(fmt, tmp_path / fmt, ours, target)
    _drop_weight(path, "layers.1.mlp.up_proj.weight")
    with pytest.raises(ValueError, match=rf"{fmt} checkpoint cannot be mapped: missing weight\(s\) "
                                         r"\['layers.1.mlp.up_proj.weight'\]"):
        load_drafter(path, target=TargetModel(target))


def test_pickled_weights_are_never_opened(tmp_path, ours):
    path = write_modelopt(tmp_path / "mo", ours)
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="found pytorch_model.bin, a pickle, which is never loaded"):
        load_drafter(path)


def test_sharded_weights_load(tmp_path, target, ours):
    path = write_modelopt(tmp_path / "mo", ours)
    state = load_file(str(path / "model.safetensors"))
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: state[k] for k in keys}, str(path / file))
    (path / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {k: f for f, keys in halves.items() for k in keys}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = load_drafter(path, target=TargetModel(target))
    assert all(torch.equal(v, state[k]) for k, v in loaded.state_dict().items())


# ------------------------------------------------------------ dflash-eval and dflash-train
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_inputs(tmp_path_factory.mktemp("tiny"))


def _tiny_drafter(tiny, layers=1):
    """A drafter shaped like tiny_train_config's (1 layer, blocks of 8, mask 16) for the tiny target."""
    cfg = make_tiny_target("llama", vocab=len(tiny["tok"])).config
    return random_drafter(cfg, seed=3, mask_token_id=16, num_hidden_layers=layers, block_size=8)


def test_eval_runs_a_foreign_drafter_and_names_what_it_cannot_map(tiny, tmp_path):
    drafter = _tiny_drafter(tiny)
    zlab = tmp_path / "zlab"
    write_zlab(zlab, drafter)
    args = [f"target.name={tiny['target']}", "target.mask_token_id=16", "datasets=[mtbench]", "limit=1",
            "max_new_tokens=4"]
    done = run_cli("dflash-eval", f"drafter_path={zlab}", f"output_dir={tmp_path / 'eval'}", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "eval" / "results.json").read_text())["datasets"]["mtbench"]
    assert result["num_prompts"] == 1 and result["tau"] >= 1.0
    causal = write_modelopt(tmp_path / "mo", drafter, config_edit=_edit("causal", True, nested=True))
    done = run_cli("dflash-eval", f"drafter_path={causal}", f"output_dir={tmp_path / 'eval2'}", *args)
    assert_one_line_error(done, "dflash-eval", "modelopt checkpoint sets dflash_config.causal=True")
    assert not (tmp_path / "eval2").exists()


def test_training_starts_from_a_foreign_drafter(tiny, tmp_path):
    drafter = _tiny_drafter(tiny)
    path = write_modelopt(tmp_path / "mo", drafter)
    t = Trainer(tiny_train_config(tiny["target"], tiny["data"], tmp_path / "run", drafter={"init_from": str(path)}))
    written = load_file(str(path / "model.safetensors"))
    assert set(t.drafter.state_dict()) == set(written)
    for name, tensor in t.drafter.state_dict().items():
        assert torch.equal(tensor, written[name]), name


def test_warm_start_geometry_must_match_the_recipe(tiny, tmp_path):
    path = write_modelopt(tmp_path / "mo", _tiny_drafter(tiny, layers=2))
    with pytest.raises(ValueError, match=r"drafter.init_from=.*mo: the checkpoint has num_hidden_layers=2 but this "
                                         r"run builds 1 \(drafter.num_hidden_layers\)"):
        Trainer(tiny_train_config(tiny["target"], tiny["data"], tmp_path / "run", drafter={"init_from": str(path)}))
    with pytest.raises(ValueError, match="drafter.init_from='/nowhere' is not a directory"):
        tiny_train_config(tiny["target"], tiny["data"], tmp_path / "run", drafter={"init_from": "/nowhere"})


def test_a_speculators_config_without_block_size_takes_that_formats_default(tmp_path, target, ours):
    """DFlashSpeculatorConfig defaults block_size to 8, not our 16: a config that leaves the
    key out (the format's own writer does when it is the default) drafts blocks of 8."""
    path = write_speculators(tmp_path / "spec", ours, target, config_edit=_edit("block_size"))
    assert "block_size" not in json.loads((path / "config.json").read_text())
    assert read_foreign(path, num_target_layers=6).config.block_size == 8
