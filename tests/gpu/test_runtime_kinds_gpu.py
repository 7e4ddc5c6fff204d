"""GPU: the static runtime's CUDA graphs replay what its eager steps compute for DFlash2 and
DSpark drafters: the selector walk and the Markov loop are captured inside the draft step
(greedy), so a host read or a Python value fixed at capture time inside them shows up here
as different tokens or lengths. The CPU tests (tests/unit/test_runtime_kinds.py) check the
eager steps against the dynamic runtime."""

import copy

import pytest
import torch

from dflash_train.eval.acceptance import target_generate
from dflash_train.eval.static_batched import speculate_static_batch
from dflash_train.model.dflash import NO_CLOCK, Sampling
from dflash_train.model.runtime import spec_generate, speculate_static
from tests.gpu.test_runtime_gpu import check_compiled_draft_keeps_the_targets_tokens
from tests.unit.test_runtime_drafter import NEW_TOKENS, prompts, target  # noqa: F401 (fixtures)
from tests.unit.test_runtime_kinds import KINDS, train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def on_gpu(target, prompts):  # noqa: F811
    """The CPU tests' tiny target and a trained drafter of each kind, in float32 on the GPU."""
    return copy.deepcopy(target).cuda(), {kind: train(kind, target, prompts).cuda() for kind in KINDS}


def _static(drafter, model, ids, new, graphs, k=None):
    return speculate_static(drafter, model, ids, new, Sampling(), None, None, None, NO_CLOCK, graphs=graphs,
                            verify_tokens=k)


@pytest.mark.parametrize("k", [1, None], ids=lambda k: f"k{k}")
@pytest.mark.parametrize("kind", KINDS)
def test_graphs_give_the_eager_steps_tokens_and_lengths(on_gpu, prompts, kind, k):  # noqa: F811
    model, drafters = on_gpu
    drafter = drafters[kind]
    lengths = []
    for new in (NEW_TOKENS, 13):  # 13: the last blocks are cut by the budget (DFlash2's narrowed)
        for prompt in prompts:
            ids = prompt[None].cuda()
            eager = _static(drafter, model, ids, new, graphs=False, k=k)
            graphed = _static(drafter, model, ids, new, graphs=True, k=k)
            assert drafter.__dict__["_static_runtime"].greedy_step.graph is not None  # really replayed
            dynamic = spec_generate(drafter, model, ids, new, return_stats=True, static=False, verify_tokens=k)
            assert torch.equal(graphed.output_ids, target_generate(model, ids, new))
            assert torch.equal(graphed.output_ids, eager.output_ids)
            assert graphed.acceptance_lengths == eager.acceptance_lengths == dynamic.acceptance_lengths
            lengths += graphed.acceptance_lengths
    assert sum(lengths) / len(lengths) > 1.5  # drafts are accepted: the draft graph matters


@pytest.mark.parametrize("kind", KINDS)
def test_batched_graphs_give_the_eager_steps_tokens_and_lengths(on_gpu, prompts, kind):  # noqa: F811
    model, drafters = on_gpu
    drafter = drafters[kind]
    rows = [p.tolist() for p in prompts]
    plain = [target_generate(model, torch.tensor([r], device="cuda"), NEW_TOKENS)[0, len(r):].tolist() for r in rows]
    for size in (2, 4):
        eager = speculate_static_batch(drafter, model, rows[:size], NEW_TOKENS, Sampling(), graphs=False)
        graphed = speculate_static_batch(drafter, model, rows[:size], NEW_TOKENS, Sampling(), graphs=True)
        assert drafter.__dict__["_static_runtime"].greedy_step.graph is not None
        assert [o.output_ids[0, len(r):].tolist() for r, o in zip(rows, graphed)] == plain[:size]
        assert [o.acceptance_lengths for o in graphed] == [o.acceptance_lengths for o in eager]


@pytest.mark.parametrize("kind", KINDS)
def test_sampled_graphs_decode(on_gpu, prompts, kind):  # noqa: F811
    """Sampling replays the drafter's forward (`hidden_step`) and picks eagerly: it runs, the
    drafter's graph is captured, and a step commits at most a whole verify."""
    model, drafters = on_gpu
    drafter = drafters[kind]
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = spec_generate(drafter, model, prompts[:1].cuda(), NEW_TOKENS, temperature=0.7, return_stats=True,
                        generator=gen, static=True)
    assert drafter.__dict__["_static_runtime"].hidden_step.graph is not None
    assert out.num_new_tokens == NEW_TOKENS and max(out.acceptance_lengths) <= drafter.drafts_per_block + 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_compiled_draft_step_keeps_the_targets_tokens(on_gpu, prompts, kind):  # noqa: F811
    model, drafters = on_gpu
    check_compiled_draft_keeps_the_targets_tokens(drafters[kind], model, prompts, NEW_TOKENS)
