"""Every number of every command's settings is range-checked in one place: each one, set to
-1, 0 and a huge value, is either taken or refused in one line naming its key (and -1,
a negative interval, budget or count, is always refused)."""

import copy
import dataclasses
import functools
import math
import typing

import pytest
from omegaconf import OmegaConf

from data_gen.config import DatagenConfig
from dflash_train import bench, quality
from dflash_train.config import TrainConfig, validate
from dflash_train.eval import cli as eval_cli
from dflash_train.recipe import MIN, _dataclass_in, compose_recipe, to_config

HUGE = 10**12
# Each command's schema, a recipe and a command line it takes, and its checks.
COMMANDS = {
    "dflash-train": (TrainConfig, "train_quickstart", ["data.path=d", "output_dir=o"], validate),
    "dflash-bench": (bench.BenchConfig, "train_quickstart", ["data.path=random", "output_dir=o", "+bench={}"],
                     bench.validate_bench),
    "dflash-eval": (eval_cli.EvalConfig, "eval", ["drafter_path=random", "target=smollm2_135m"], eval_cli.validate),
    "dflash-quality": (quality.QualityConfig, "quality", ["target=smollm2_135m", "data.path=d", "budget_min=1"],
                       quality.validate),
    "dflash-datagen": (DatagenConfig, "datagen_all_turns", ["out_dir=o"], DatagenConfig.validate),
}


def numeric_keys(schema, prefix: str = "", raw=None) -> list[str]:
    """Every number's dotted key in ``schema`` (list items by index, as in ``raw``)."""
    keys = []
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        key, hint = f"{prefix}{f.name}", hints[f.name]
        inner = _dataclass_in(hint)
        value = None if raw is None else raw.get(f.name)
        if inner is not None and typing.get_origin(hint) is list:
            keys += [k for i, item in enumerate(value or []) for k in numeric_keys(inner, f"{key}.{i}.", item)]
        elif inner is not None:
            keys += numeric_keys(inner, f"{key}.", value)
        elif typing.get_origin(hint) is list and float in typing.get_args(hint):
            keys += [f"{key}.{i}" for i in range(len(value or []))]
        elif int in (typing.get_args(hint) or (hint,)) or float in (typing.get_args(hint) or (hint,)):
            keys.append(key)
    return keys


@functools.cache
def composed(prog: str):
    schema, recipe, args, _ = COMMANDS[prog]
    return compose_recipe(schema, recipe, args)


def _cases():
    for prog, (schema, *_) in COMMANDS.items():
        raw = OmegaConf.to_container(composed(prog))
        for key in numeric_keys(schema, raw=raw):
            for value in (-1, 0, HUGE):
                yield pytest.param(prog, key, value, id=f"{prog}-{key}={value}")


def _shown(key: str) -> str:
    """``sources.1.max_tokens`` as the messages write it: ``sources[1].max_tokens``."""
    parts = key.split(".")
    out = parts[0]
    for part in parts[1:]:
        out += f"[{part}]" if part.isdigit() else f".{part}"
    return out


@pytest.mark.parametrize("prog, key, value", list(_cases()))
def test_every_number_is_taken_or_refused_naming_its_key(prog, key, value):
    schema, _, _, check = COMMANDS[prog]
    raw = copy.deepcopy(composed(prog))
    OmegaConf.update(raw, key, value, force_add=True)
    try:
        to_config(schema, raw, check)
    except ValueError as err:
        message = str(err)
        assert "\n" not in message
        assert _shown(key).split("[")[0] in message or _shown(key) in message, message
        return
    assert value != -1, f"{prog} took {key}=-1"


def test_the_one_check_names_key_and_value():
    raw = compose_recipe(TrainConfig, "train_quickstart", ["data.path=d", "output_dir=o", "checkpoint.every=-1"])
    with pytest.raises(ValueError, match=r"^checkpoint.every=-1 must be a finite number >= 0$"):
        to_config(TrainConfig, raw, validate)
    raw = compose_recipe(TrainConfig, "train_quickstart", ["data.path=d", "output_dir=o", "optim.lr=nan"])
    with pytest.raises(ValueError, match=r"^optim.lr=nan must be a finite number >= 0$"):
        to_config(TrainConfig, raw, validate)
    raw = compose_recipe(TrainConfig, "train_quickstart", ["data.path=d", "output_dir=o", "optim.betas=[0.9,-0.1]"])
    with pytest.raises(ValueError, match=r"^optim.betas\[1\]=-0.1 must be a finite number >= 0$"):
        to_config(TrainConfig, raw, validate)
    assert math.isfinite(HUGE)


def test_a_declared_minimum_is_the_one_checked():
    from dflash_train.recipe import check_numbers

    @dataclasses.dataclass
    class Steps:
        every: int = dataclasses.field(default=1, metadata={MIN: 1})

    check_numbers(Steps(every=1))
    with pytest.raises(ValueError, match=r"^every=0 must be a finite number >= 1$"):
        check_numbers(Steps(every=0))
