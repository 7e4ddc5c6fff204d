"""Sampling settings have one check (model/dflash.py's check_sampling): the exported
runtime, dflash-eval and data generation refuse the same values with the same message."""

import re

import pytest

from data_gen.config import SamplingConfig
from dflash_train.eval.cli import RANDOM_DRAFTER, EvalConfig, validate
from dflash_train.model.dflash import Sampling


@pytest.mark.parametrize("temperature, top_p, top_k, message", [
    (-0.5, 1.0, 0, "temperature=-0.5: must be >= 0 (0 is greedy)"),
    (1.0, 0.0, 0, "top_p=0.0: must be in (0, 1]"),
    (1.0, 1.5, 0, "top_p=1.5: must be in (0, 1]"),
    (1.0, 1.0, -1, "top_k=-1: must be >= 0 (0 disables it)"),
])
def test_the_runtime_and_data_generation_refuse_the_same_values(temperature, top_p, top_k, message):
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        Sampling(temperature, top_p, top_k)
    with pytest.raises(ValueError, match="^" + re.escape("sampling." + message) + "$"):
        SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k).validate()


def test_eval_refuses_a_negative_temperature_like_the_runtime():
    with pytest.raises(ValueError, match=r"^temperature=-0\.5: must be >= 0 \(0 is greedy\)$"):
        validate(EvalConfig(drafter_path=RANDOM_DRAFTER, temperature=-0.5))
    validate(EvalConfig(drafter_path=RANDOM_DRAFTER, temperature=0.7))


def test_valid_settings_pass():
    assert Sampling(0.7, 0.9, 5).greedy is False
    SamplingConfig(temperature=0.0, top_p=1.0, top_k=0).validate()
