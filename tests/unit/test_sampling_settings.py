"""Sampling settings and verify_tokens have one rule in two homes: model/dflash.py's checks
(the exported runtime's, which imports nothing of ours) and model/runtime_checks.py's (the
commands', which import no torch). The runtime, dflash-eval and data generation refuse the
same values with the same message."""

import re

import pytest

from data_gen.config import SamplingConfig
from dflash_train.contract_base import DRAFTER_KINDS, drafts_per_block
from dflash_train.eval.settings import RANDOM_DRAFTER, EvalConfig, validate
from dflash_train.model import dflash, runtime_checks
from dflash_train.model.dflash import Sampling
from dflash_train.model.kinds import KINDS
from tests.conftest import make_tiny_target


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


@pytest.mark.parametrize("verify_tokens, block_size", [(None, 16), (1, 16), (15, 16), (16, 16), (0, 8), (True, 8),
                                                       (2.0, 8), (8, 9)])
def test_the_runtime_and_the_commands_bound_verify_tokens_alike(verify_tokens, block_size):
    """model/dflash.py (copied beside exports, importing nothing of ours) and the commands'
    torch-free copy (model/runtime_checks.py) give the same answer or the same refusal."""
    outcomes = []
    for check in (dflash.check_verify_tokens, runtime_checks.check_verify_tokens):
        try:
            outcomes.append(check(verify_tokens, block_size))
        except ValueError as err:
            outcomes.append(str(err))
    assert outcomes[0] == outcomes[1]


@pytest.mark.parametrize("kind", DRAFTER_KINDS)
def test_a_kinds_drafts_per_block_is_its_models(kind):
    """contract_base.drafts_per_block (dflash-eval's bound before any model is built) is the
    property of the drafter the kind builds."""
    config_class, model_class = KINDS[kind]
    config = config_class.from_target(make_tiny_target().config, mask_token_id=3, num_hidden_layers=1, block_size=8)
    assert model_class(config).drafts_per_block == drafts_per_block(kind, 8)
