"""Recipe validation: unknown keys and bad values are ValueErrors that name them."""

import pytest
from omegaconf import OmegaConf

from dflash_train.config import to_train_config
from tests.conftest import pretend_flash_attention

BASE = {"target": {"name": "t", "mask_token_id": 1, "num_layers": 30}, "data": {"path": "d"}, "output_dir": "o"}


def _cfg(**patch):
    return OmegaConf.merge(OmegaConf.create(BASE), OmegaConf.create(patch))


def test_defaults_are_the_paper_settings():
    c = to_train_config(_cfg())
    assert (c.optim.lr, c.optim.warmup_ratio, c.optim.grad_clip, c.data.max_length, c.data.num_anchors) == (
        6e-4, 0.04, 1.0, 3072, 512)
    assert (c.drafter.num_hidden_layers, c.drafter.block_size, c.epochs) == (5, 16, 6)


def test_unknown_key_is_named():
    with pytest.raises(ValueError, match="data.num_anchor"):
        to_train_config(_cfg(data={"num_anchor": 3}))


def test_missing_required_value_is_named():
    with pytest.raises(ValueError, match="output_dir"):
        to_train_config(OmegaConf.create({k: v for k, v in BASE.items() if k != "output_dir"}))


@pytest.mark.parametrize("patch, key", [({"epochs": "???"}, "epochs"), ({"optim": {"lr": "???"}}, "optim.lr")])
def test_a_placeholder_left_in_a_field_with_a_default_is_refused(patch, key):
    # OmegaConf would give the field its default: the run would go on with a value nobody chose
    with pytest.raises(ValueError, match=rf"^missing value for {key}: add {key}=\.\.\. to the command$"):
        to_train_config(_cfg(**patch))


@pytest.mark.parametrize(
    "patch, message",
    [
        ({"drafter": {"target_layer_ids": [3, 40]}}, r"target_layer_ids=\[3, 40\] but the target has 30 layers"),
        ({"drafter": {"block_size": 12}}, "block_size=12"),
        ({"drafter": {"attention": "sdpa"}}, "drafter.attention='sdpa'"),
        ({"drafter": {"flex_backend": "cutlass"}}, "drafter.flex_backend='cutlass'"),
        ({"drafter": {"flex_backend": "flash", "attention": "dense", "compile": True}}, "attention='dense'"),
        ({"drafter": {"flex_backend": "flash", "attention": "flex", "compile": False}}, "compile=False"),
        ({"optim": {"warmup_ratio": 1.5}}, "warmup_ratio=1.5"),
        ({"optim": {"micro_batch_size": 0}}, "optim.micro_batch_size"),
        ({"data": {"max_length": 8}}, "max_length=8 must exceed drafter.block_size=16"),
        ({"logging": {"wandb": "maybe"}}, "logging.wandb='maybe'"),
        ({"target": {"mask_token_id": -1}}, "mask_token_id=-1"),
        ({"drafter": {"target_layer_ids": [1, 2], "num_features": 3}}, "num_features=3"),
        ({"drafter": {"kind": "dflash2", "dflash2": {"conv_delta_scale": -1}}},
         r"^drafter.dflash2.conv_delta_scale=-1 must be a finite number >= 0"),
        ({"drafter": {"kind": "dflash2", "dflash2": {"conv_delta_scale": "nan"}}},
         r"^drafter.dflash2.conv_delta_scale=nan must be a finite number >= 0"),
        ({"drafter": {"kind": "dflash2", "dflash2": {"selector_stop_gradient": "maybe"}}},
         r"^wrong type for drafter.dflash2.selector_stop_gradient='maybe'"),
    ],
)
def test_bad_values_are_reported_with_the_values(patch, message):
    with pytest.raises(ValueError, match=message):
        to_train_config(_cfg(**patch))


def test_block_size_without_paper_gamma_works_with_explicit_gamma():
    assert to_train_config(_cfg(drafter={"block_size": 12}, loss={"gamma": 6.0})).loss.gamma == 6.0


def test_a_schema_key_the_recipe_lacks_is_not_called_a_typo():
    """target.compile is a training key: the training recipes set it, the evaluation recipe
    does not, and the error must not suggest the very key that was given."""
    from dflash_train.config import TrainConfig
    from dflash_train.eval.cli import EvalConfig
    from dflash_train.recipe import compose_recipe

    cfg = compose_recipe(TrainConfig, "train", ["target.compile=true", "data.path=d", "output_dir=o"])
    assert to_train_config(cfg).target.compile is True
    with pytest.raises(ValueError) as err:
        compose_recipe(EvalConfig, "eval", ["target.compile=true", "drafter_path=random"])
    assert str(err.value) == "unknown key target.compile: not in this recipe (+target.compile=... adds it)"


def test_a_compiled_target_cannot_be_sharded():
    with pytest.raises(ValueError, match="target.compile=true with backend.shard_target=true"):
        to_train_config(_cfg(target={"compile": True}, backend={"shard_target": True}))


def test_the_flash_backend_without_flash_attention_installed_says_what_to_install(monkeypatch):
    pretend_flash_attention(monkeypatch, installed=False)
    with pytest.raises(ValueError, match="pip install --pre flash-attn-4"):
        to_train_config(_cfg(drafter={"flex_backend": "flash", "attention": "flex", "compile": True}))


def test_the_flash_backend_without_the_cute_dsl_on_the_path_says_how_to_add_it(monkeypatch):
    pretend_flash_attention(monkeypatch, cutlass=False)
    with pytest.raises(ValueError, match="no module 'cutlass'.*dsl_packages to PYTHONPATH"):
        to_train_config(_cfg(drafter={"flex_backend": "flash", "attention": "flex", "compile": True}))


def test_the_flash_backend_with_flash_attention_installed_is_accepted(monkeypatch):
    pretend_flash_attention(monkeypatch)
    cfg = to_train_config(_cfg(drafter={"flex_backend": "flash", "attention": "flex", "compile": True}))
    assert cfg.drafter.flex_backend == "flash"
    assert to_train_config(_cfg()).drafter.flex_backend == "triton"  # the default needs nothing extra


def test_the_dflash2_levers_validate_directly():
    # validate itself names the value (the recipe path's generic number check says it first)
    from dflash_train.config import validate

    cfg = to_train_config(_cfg(drafter={"kind": "dflash2"}))
    assert (cfg.drafter.dflash2.selector_stop_gradient, cfg.drafter.dflash2.conv_delta_scale) == (False, 0.1)
    cfg.drafter.dflash2.conv_delta_scale = -1.0
    with pytest.raises(ValueError, match=r"^drafter.dflash2.conv_delta_scale=-1.0 must be a finite number >= 0 "
                                         r"\(1: the dynamic kernels as published, 0.1: damped, 0: frozen at zero\)$"):
        validate(cfg)
