"""GPU: the batched static runtime's CUDA graphs replay what its eager steps compute, for
ragged batches of several sizes (the CPU tests check the eager steps against batch 1)."""

import copy

import pytest
import torch

from dflash_train.eval.acceptance import target_generate
from dflash_train.eval.static_batched import plain_static_batch, speculate_static_batch
from dflash_train.model.dflash import Sampling
from tests.unit.test_runtime_drafter import NEW_TOKENS, prompts, target, trained  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def on_gpu(target, trained):  # noqa: F811
    """The CPU tests' tiny target and trained drafter (tau about 2.4), in float32 on the GPU."""
    return copy.deepcopy(target).cuda(), copy.deepcopy(trained).cuda()


def test_batched_graphs_give_the_eager_steps_tokens_and_lengths(on_gpu, prompts):  # noqa: F811
    model, drafter = on_gpu
    rows = [target_generate(model, prompts[i:i + 1].cuda(), k)[0].tolist() if k else prompts[i].tolist()
            for i, k in enumerate((0, 2, 1, 3))]  # ragged: some extended by the start of their own answers
    plain = [target_generate(model, torch.tensor([r], device="cuda"), NEW_TOKENS)[0, len(r):].tolist() for r in rows]
    for size in (2, 3, 4):
        eager = speculate_static_batch(drafter, model, rows[:size], NEW_TOKENS, Sampling(), graphs=False)
        graphed = speculate_static_batch(drafter, model, rows[:size], NEW_TOKENS, Sampling(), graphs=True)
        assert drafter.__dict__["_static_runtime"].greedy_step.graph is not None  # really replayed (the device loop)
        assert [o.output_ids[0, len(r):].tolist() for r, o in zip(rows, graphed)] == plain[:size]
        assert [o.acceptance_lengths for o in graphed] == [o.acceptance_lengths for o in eager]
        assert plain_static_batch(model, rows[:size], NEW_TOKENS) == plain[:size]
        assert model.__dict__["_static_runtime"].step.graph is not None
