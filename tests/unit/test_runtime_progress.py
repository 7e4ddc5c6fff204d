"""Every decode loop refuses a step that commits no token, naming the step and the row.

A step always commits at least the target's own next token, and the loops end on a length
or a stop token: a step that commits nothing (a bug in the acceptance or the stop-token
cut) would be repeated forever. Each test forces such a step through the loop's own code
(the planted stop-token bug, an acceptance function that accepts less than nothing) and
expects the error; the timeout turns a loop that spins anyway into a failure.
"""

import pytest
import torch

import dflash_train.model.dflash as dflash
import dflash_train.model.runtime as runtime
from dflash_train.eval.batched import Rows
from dflash_train.eval.static_batched import speculate_static_batch
from dflash_train.model.dflash import DFlashConfig, DFlashDraftModel, Sampling
from dflash_train.model.runtime import greedy_accepted, spec_generate
from tests.conftest import make_tiny_target

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.timeout(120)]

NEW = 24


@pytest.fixture(scope="module")
def models():
    target = make_tiny_target("qwen3")
    cfg = DFlashConfig.from_target(target.config, mask_token_id=96, num_hidden_layers=1, block_size=4)
    return DFlashDraftModel(cfg).eval(), target


def prompt(seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 90, (1, 7), generator=torch.Generator().manual_seed(seed))


def commit_nothing_before_a_first_stop(committed: list[int], stops: set) -> list[int]:
    """The planted bug: cut before the stop token instead of after it, so a step whose
    first committed token is a stop token commits nothing."""
    for i, tok in enumerate(committed):
        if tok in stops:
            return committed[:i]
    return committed


def a_step_opened_by_a_new_token(drafter, target, ids) -> tuple[int, int]:
    """(step, token): a step of the plain run whose first committed token appears nowhere
    before it, so a stop on that token changes nothing until that step."""
    out = spec_generate(drafter, target, ids, NEW, return_stats=True, static=False)
    new = out.output_ids[0, ids.shape[1]:].tolist()
    first = 1  # new[0] comes from the prefill; step j's first token follows steps 0..j-1
    for step, length in enumerate(out.acceptance_lengths):
        if step >= 1 and new[first] not in new[:first]:
            return step, new[first]
        first += length
    raise AssertionError(f"no step opens with a new token in {new}")


@pytest.mark.parametrize("static, time_steps", [(False, False), (True, True)])
def test_a_step_that_commits_nothing_is_an_error_not_a_hang(models, monkeypatch, static, time_steps):
    """The dynamic loop and the static runtime's per-step loop (a clock makes it read each
    step on the host) under the planted stop-token bug."""
    drafter, target = models
    ids = prompt()
    step, stop = a_step_opened_by_a_new_token(drafter, target, ids)
    monkeypatch.setattr(dflash, "cut_after_stop", commit_nothing_before_a_first_stop)
    monkeypatch.setattr(runtime, "cut_after_stop", commit_nothing_before_a_first_stop)
    with pytest.raises(RuntimeError, match=rf"^decode step {step} of row 0 committed no token: the loop cannot "
                                           "advance$"):
        spec_generate(drafter, target, ids, NEW, stop_token_ids=[stop], static=static, time_steps=time_steps)


def accepting_nothing_from(step: int, row: int):
    """`greedy_accepted` of the device loop, but from its ``step``-th call on ``row`` accepts
    -1 drafts: a count of 0 committed tokens, every step after (the row never finishes)."""
    calls = [0]

    def accepted(drafts, target_tokens, usable):
        out = greedy_accepted(drafts, target_tokens, usable)
        calls[0] += 1
        if calls[0] > step:
            out[row] = -1
        return out

    return accepted


def test_the_device_loop_names_the_row_that_stopped_moving(models, monkeypatch):
    """The greedy device loop (no host copy per step) checks at its reads between runs of
    steps: here three prompts together, the second one committing nothing from step 2."""
    drafter, target = models
    prompts = [prompt(seed)[0].tolist() for seed in (3, 4, 5)]
    fine = speculate_static_batch(drafter, target, prompts, NEW, Sampling())
    assert all(len(out.acceptance_lengths) > 2 for out in fine)
    monkeypatch.setattr(runtime, "greedy_accepted", accepting_nothing_from(step=2, row=1))
    with pytest.raises(RuntimeError, match=r"^decode step 2 of row 1 committed no token"):
        speculate_static_batch(drafter, target, prompts, NEW, Sampling())
    monkeypatch.setattr(runtime, "greedy_accepted", accepting_nothing_from(step=0, row=0))
    with pytest.raises(RuntimeError, match=r"^decode step 0 of row 0 committed no token"):
        spec_generate(drafter, target, prompt(), NEW, static=True)


def test_the_batched_loops_refuse_an_empty_commit():
    """Both batched evaluation loops (dynamic, static with sampling) record through `Rows`."""
    rows = Rows(2, max_new_tokens=8, stops={5}, first=[1, 2])
    rows.record(0, [3, 4])
    rows.record(1, [7])
    with pytest.raises(RuntimeError, match=r"^decode step 1 of row 1 committed no token"):
        rows.record(1, [])
    assert (rows.new, rows.lengths) == ([[1, 3, 4], [2, 7]], [[2], [1]])
