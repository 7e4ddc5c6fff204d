"""DFlash2's two training-only A/B options (issue 38, levers 1b and 2 of the DFlash2 audit):
drafter.dflash2.selector_stop_gradient and drafter.dflash2.conv_delta_scale.

At (false, 1.0) the drafter and its step are those of before the options (the default
scale is 0.1 since 2026-11-28's lease; a recipe spells 1.0 for the authors'); the stop-gradient keeps the selector term's loss out of
the backbone; the scale multiplies the kernel projections in the forward and is folded into
the exported weights, so the export (our loader, the dflash2.py beside it) computes what the
trained drafter did, bit for bit, with no new config key.
"""

import json

import pytest
import torch
from transformers import AutoModel

from dflash_train.contract import block_input_ids, block_position_ids
from dflash_train.model.dflash import FULL_ATTENTION, visible_mask
from dflash_train.model.dflash2 import DFlash2Config, DFlash2DraftModel, KernelProjection
from dflash_train.model.init import drafter_config
from dflash_train.model.io import load_drafter
from dflash_train.training.trainer import Trainer
from tests.conftest import make_tiny_target
from tests.train_data import tiny_inputs, tiny_train_config
from tests.unit.test_export import copy_export

pytestmark = pytest.mark.usefixtures("one_thread")

MASK_ID = 96
SCALE = 0.1  # not a power of two: folding it is a real rounding, done once


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_inputs(tmp_path_factory.mktemp("levers"))


def _cfg(tiny, out, dflash2=None, init_from=None, recipe_scale=False, **kw):
    """The tests' DFlash2 recipe, at the authors' scale 1 unless ``dflash2`` names one (or
    ``recipe_scale``: the recipe's default)."""
    # A wide top-K lets some slots of a random drafter cover their gold token (test_dflash2.py).
    settings = {"selector_rank": 8, "selector_top_k": 2048, **({} if recipe_scale else {"conv_delta_scale": 1.0}),
                **(dflash2 or {})}
    drafter = {"kind": "dflash2", "dflash2": settings, **({"init_from": init_from} if init_from else {})}
    return tiny_train_config(tiny["target"], tiny["data"], out, drafter=drafter, **kw)


def _randomise(drafter, seed=3):
    """Trained-looking convolutions and selector (the fresh ones are the identity and zeros)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "conv" in name or "selector" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _step(trainer):
    """One micro-batch's loss and every parameter's gradient (randomised DFlash2 parts)."""
    _randomise(trainer.drafter)
    out = trainer.micro_step(trainer.micro_batches(0)[0])
    out.weighted_sum.backward()
    return out.weighted_sum.detach(), {k: p.grad.clone() for k, p in trainer.drafter.named_parameters()}


def _is_selector(name):
    return name.startswith("candidate_selector.")


# ---------------------------------------------------------------------------------- defaults
def test_the_options_off_build_the_drafter_and_step_of_before(tiny, tmp_path):
    """false and 1.0: no attribute in the drafter config (its dict is the one built without
    the options), every kernel projection is a plain Linear; a step moves every part."""
    off = Trainer(_cfg(tiny, tmp_path / "d", {"selector_stop_gradient": False, "conv_delta_scale": 1.0}, max_steps=1))
    before = DFlash2Config.from_target(off.target.config, mask_token_id=16, num_hidden_layers=1, block_size=8,
                                       selector_rank=8, selector_top_k=2048,
                                       target_layer_ids=off.drafter_config.dflash_config["target_layer_ids"])
    assert off.drafter_config.to_dict() == before.to_dict()
    assert not hasattr(off.drafter_config, "conv_delta_scale")
    assert all(m.scale == 1 for m in off.drafter.modules() if isinstance(m, KernelProjection))
    _, grads = _step(off)
    assert all(bool(g.any()) for g in grads.values())  # every part, convolutions and selector included, moved


def test_a_recipe_that_names_no_scale_trains_at_a_tenth(tiny, tmp_path):
    """The default scale is 0.1: every kernel projection multiplies by it, and a step's loss
    and gradients are those of a recipe that spells 0.1 out."""
    default = Trainer(_cfg(tiny, tmp_path / "d", recipe_scale=True, max_steps=1))
    explicit = Trainer(_cfg(tiny, tmp_path / "e", {"conv_delta_scale": SCALE}, max_steps=1))
    assert default.drafter_config.conv_delta_scale == SCALE
    assert all(m.scale == SCALE for m in default.drafter.modules() if isinstance(m, KernelProjection))
    loss, grads = _step(default)
    loss2, grads2 = _step(explicit)
    assert torch.equal(loss, loss2)
    for k, g in grads.items():
        assert torch.equal(grads2[k], g), k


def test_at_scale_one_a_kernel_projection_is_its_linear():
    torch.manual_seed(0)
    proj = KernelProjection(8, 6, bias=False)
    with torch.no_grad():
        proj.weight.normal_()
    x = torch.randn(3, 8, requires_grad=True)
    y = proj(x)
    assert torch.equal(y, torch.nn.functional.linear(x, proj.weight))
    y.sum().backward()
    assert torch.equal(proj.weight.grad, torch.ones(3, 6).T @ x.detach())


# ------------------------------------------------------------------- selector_stop_gradient
def test_stop_gradient_keeps_the_selector_term_out_of_the_backbone(tiny, tmp_path):
    """The loss is the full one; the backbone's gradients (convolutions included) are those of
    a run without the selector term, bit for bit; the selector's own are those of the run
    where its term reaches everything."""
    runs = {name: _step(Trainer(_cfg(tiny, tmp_path / name, settings, max_steps=1)))
            for name, settings in [("stop", {"selector_stop_gradient": True}), ("off", {"selector_loss_weight": 0.0}),
                                   ("on", {})]}
    (stop, g_stop), (off, g_off), (on, g_on) = runs["stop"], runs["off"], runs["on"]
    assert torch.equal(stop, on) and stop > off  # the same selector term in the loss
    backbone = [k for k in g_stop if not _is_selector(k)]
    assert "layers.0.attention_conv.kernel_projection.weight" in backbone and "fc.weight" in backbone
    for k in backbone:
        assert torch.equal(g_stop[k], g_off[k]), k
    assert not torch.equal(g_on["fc.weight"], g_off["fc.weight"])  # without the option it does reach them
    for k in ("candidate_selector.hidden_projection.weight", "candidate_selector.predecessor_codebook",
              "candidate_selector.successor_codebook"):
        assert bool(g_stop[k].any()), k
        assert torch.equal(g_stop[k], g_on[k]), k  # the selector learns exactly as before
        assert not g_off[k].any(), k


# ------------------------------------------------------------------------- conv_delta_scale
def _forward_inputs(embed, drafter, mask_id, seed=5):
    """A training-layout forward's arguments: two blocks over a context of 10 random features."""
    t, b, hidden = 10, drafter.block_size, drafter.config.hidden_size
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, 90, (t,), generator=g)
    anchors = torch.tensor([[2, 6]])
    blocks = block_input_ids(seq, anchors[0], b, mask_id).flatten()[None]
    feats = torch.randn(1, t, len(drafter.target_layer_ids) * hidden, generator=g)
    positions = torch.cat([torch.arange(t), block_position_ids(torch.arange(t), anchors[0], b).flatten()])[None]
    with torch.no_grad():
        noise = embed(blocks)
    return noise, feats, positions, {FULL_ATTENTION: visible_mask(anchors, t, b)}


def test_the_scale_multiplies_the_kernel_projections_in_the_forward():
    target = make_tiny_target("qwen3", layers=4, seed=3)
    kw = dict(mask_token_id=MASK_ID, num_hidden_layers=2, block_size=4, selector_rank=8, selector_top_k=4)
    scaled = DFlash2DraftModel(DFlash2Config.from_target(target.config, conv_delta_scale=SCALE, **kw)).eval()
    _randomise(scaled)
    plain = DFlash2DraftModel(DFlash2Config.from_target(target.config, **kw)).eval()
    plain.load_state_dict({k: v * SCALE if "kernel_projection" in k else v for k, v in scaled.state_dict().items()})
    inputs = _forward_inputs(target.get_input_embeddings(), scaled, MASK_ID)
    with torch.no_grad():
        got, want = scaled(*inputs), plain(*inputs)
        unscaled = DFlash2DraftModel(DFlash2Config.from_target(target.config, **kw)).eval()
        unscaled.load_state_dict(scaled.state_dict())
        assert not torch.allclose(unscaled(*inputs), got, atol=1e-3)  # the scale does change the drafter
    assert torch.equal(got, want)


def test_scale_zero_freezes_the_dynamic_kernels(tiny, tmp_path):
    trainer = Trainer(_cfg(tiny, tmp_path / "z", {"conv_delta_scale": 0.0}, max_steps=2))
    _, grads = _step(trainer)
    names = [k for k in grads if "kernel_projection" in k]
    assert len(names) == 2  # attention_conv and mlp_conv of the one layer
    for k in names:
        assert not grads[k].any(), k
    assert bool(grads["layers.0.mlp_conv.base_kernel"].any())  # the static kernel still learns
    fresh = Trainer(_cfg(tiny, tmp_path / "z2", {"conv_delta_scale": 0.0}, max_steps=2))
    fresh.fit()
    for k in names:
        assert not fresh.drafter.state_dict()[k].any(), k  # zero gradient, zero step: still zero


@pytest.fixture(scope="module")
def scaled_run(tiny, tmp_path_factory):
    """A DFlash2 run trained with conv_delta_scale=0.1 and exported at its end."""
    out = tmp_path_factory.mktemp("scaled") / "run"
    trainer = Trainer(_cfg(tiny, out, {"conv_delta_scale": SCALE}, max_steps=3, export=True))
    _randomise(trainer.drafter)  # so that the kernel projections are far from zero
    trainer.fit()
    return trainer, out / "export"


def test_the_export_serves_exactly_what_was_trained(scaled_run):
    trainer, export = scaled_run
    trained = trainer.drafter.eval()
    raw = json.loads((export / "config.json").read_text())
    assert "conv_delta_scale" not in raw and "conv_delta_scale" not in raw["dflash_config"]  # SGLang's layout
    loaded = load_drafter(export)
    remote = AutoModel.from_pretrained(str(export), trust_remote_code=True).eval()  # the dflash2.py beside it
    for model in (loaded, remote):
        assert all(m.scale == 1 for m in model.modules() if type(m).__name__ == "KernelProjection")
    name = "layers.0.attention_conv.kernel_projection.weight"
    assert torch.equal(loaded.state_dict()[name], trained.state_dict()[name] * SCALE)  # folded once
    target = trainer.target
    inputs = _forward_inputs(target.embed_tokens, trained, trainer.cfg.target.mask_token_id)
    with torch.no_grad():
        want = target.lm_head(trained(*inputs))  # (1, 2B, V): the trained drafter's logits
        for model in (loaded, remote):
            assert torch.equal(target.lm_head(model(*inputs)), want)
        unfolded = load_drafter(export)  # the trained weights without the scale serve another drafter
        unfolded.load_state_dict(trained.state_dict())
        assert not torch.allclose(target.lm_head(unfolded(*inputs)), want, atol=1e-3)


def test_dflash_export_of_a_checkpoint_folds_the_scale_once(scaled_run, tmp_path):
    from dflash_train.export.job import export_checkpoint, find_checkpoint

    trainer, export = scaled_run
    out, _ = export_checkpoint(find_checkpoint(trainer.output_dir), tmp_path / "again")
    again, first = load_drafter(out).state_dict(), load_drafter(export).state_dict()
    for k, v in first.items():
        assert torch.equal(again[k], v), k


def test_a_warm_start_under_a_scale_starts_from_the_saved_drafter(scaled_run, tiny, tmp_path):
    _, export = scaled_run
    saved = load_drafter(export)
    warm = Trainer(_cfg(tiny, tmp_path / "w", {"conv_delta_scale": 0.5}, init_from=str(export), max_steps=1))
    inputs = _forward_inputs(warm.target.embed_tokens, saved, warm.cfg.target.mask_token_id)
    name = "layers.0.mlp_conv.kernel_projection.weight"
    assert torch.equal(warm.drafter.state_dict()[name], saved.state_dict()[name] / 0.5)
    with torch.no_grad():
        torch.testing.assert_close(warm.drafter.eval()(*inputs), saved(*inputs), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"drafter.init_from=.*kernels are not zero .*conv_delta_scale=0 would drop"):
        Trainer(_cfg(tiny, tmp_path / "w0", {"conv_delta_scale": 0.0}, init_from=str(export), max_steps=1))


def test_a_config_json_carrying_the_scale_is_refused(scaled_run, tmp_path):
    # our runtime would apply it and SGLang would not: the export never writes it
    _, export = scaled_run
    edited = copy_export(export, tmp_path / "edited", lambda c: c.update(conv_delta_scale=0.5))
    with pytest.raises(ValueError, match=r"conv_delta_scale=0.5 is a training setting, folded into the weights"):
        load_drafter(edited)


def test_the_scale_reaches_the_training_drafter_config(tiny, tmp_path):
    from transformers import AutoConfig

    cfg = _cfg(tiny, tmp_path / "c", {"conv_delta_scale": SCALE})
    assert drafter_config(cfg, AutoConfig.from_pretrained(tiny["target"])).conv_delta_scale == SCALE
