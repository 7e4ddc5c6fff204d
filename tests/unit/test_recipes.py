"""Every YAML file under recipes/ composes, and every training recipe validates.

Files are globbed, not listed: a new recipe is tested the moment it exists. Primary configs
compose by name; group options compose into their primary config (train for every group,
since target recipes are shared with eval and datagen).
"""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from dflash_train.config import to_train_config

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
ALL = sorted(p.relative_to(RECIPES).as_posix() for p in RECIPES.rglob("*.yaml"))
# What a user must supply on the command line for a training recipe to be complete.
REQUIRED = ["data.path=/nonexistent/data", "output_dir=/nonexistent/run"]


def _is_train(primary: str) -> bool:
    return primary.startswith("train")


def _compose(rel: str):
    group, _, name = rel[: -len(".yaml")].rpartition("/")
    if not group:
        overrides = REQUIRED if _is_train(name) else []
        return name, compose(config_name=name, overrides=[o for o in overrides if "=" in o])
    if group == "experiment":
        return "train", compose(config_name="train", overrides=[f"+experiment={name}", *REQUIRED])
    return "train", compose(config_name="train", overrides=[f"{group}={name}", *REQUIRED])


def test_recipes_are_found():
    assert "train.yaml" in ALL and "train_quickstart.yaml" in ALL
    assert any(r.startswith("experiment/") for r in ALL)


@pytest.mark.parametrize("rel", ALL)
def test_recipe_composes(rel):
    with initialize_config_module("dflash_recipes", version_base=None):
        primary, cfg = _compose(rel)
    assert cfg is not None
    if _is_train(primary):
        train = to_train_config(cfg)  # unknown keys and bad values fail here
        assert train.output_dir


@pytest.mark.parametrize("rel", [r for r in ALL if r.startswith("experiment/")])
def test_experiments_use_the_paper_settings(rel):
    with initialize_config_module("dflash_recipes", version_base=None):
        _, cfg = _compose(rel)
    c = to_train_config(cfg)
    assert (c.optim.lr, c.optim.warmup_ratio, c.optim.schedule, c.optim.grad_clip) == (6e-4, 0.04, "cosine", 1.0)
    assert (c.data.max_length, c.data.num_anchors, c.epochs) == (3072, 512, 6)
    assert (c.drafter.num_hidden_layers, c.drafter.block_size) == (5, 16)


def test_every_recipe_starts_with_its_command():
    for rel in ALL:
        # Hydra directives ("# @package") must come first; the command is the next line.
        first = next(ln for ln in (RECIPES / rel).read_text().splitlines() if not ln.startswith("# @"))
        if rel.startswith(("experiment/", "train")):
            assert first.startswith("# ") and ("dflash-train" in first or "launch/torchrun.sh" in first), rel


def _quickstart_train_config():
    with initialize_config_module("dflash_recipes", version_base=None):
        cfg = compose(config_name="train_quickstart")
    return to_train_config(OmegaConf.merge(cfg, {"output_dir": "x"}))


def test_quickstart_runs_on_cpu_without_compile():
    c = _quickstart_train_config()
    assert c.drafter.attention == "dense" and not c.drafter.compile


def test_quickstart_trains_on_what_its_datagen_writes():
    """The two quickstart recipes agree: the same target at the same dtype (the drafter
    learns the features of the model that wrote the answers), no sequence truncated, and
    enough anchors to start a block at every other answer position."""
    train = _quickstart_train_config()
    with initialize_config_module("dflash_recipes", version_base=None):
        gen = compose(config_name="datagen_quickstart")
    assert gen.target.name == train.target.name
    assert gen.target.dtype == train.target.dtype == "bfloat16"
    assert train.backend["mixed_precision"] == "bf16"
    assert train.data.path == gen.out_dir
    # max_prompt_len counts the templated prompt; the answer follows it.
    assert train.data.max_length >= gen.max_prompt_len + gen.sampling.max_new_tokens
    assert 2 * train.data.num_anchors >= gen.sampling.max_new_tokens
