"""GPU: the static runtime's CUDA graphs replay what its eager steps compute.

The CPU tests check the static step functions against the dynamic runtime; here the same
steps are captured and replayed, so a step that reads a Python value at capture time, or a
buffer that moves after capture, shows up as different tokens.
"""

import copy

import pytest
import torch

from dflash_train.eval.acceptance import target_generate
from dflash_train.model.dflash import NO_CLOCK, DFlashConfig, DFlashDraftModel, Sampling
from dflash_train.model.runtime import spec_generate, speculate_static
from tests.conftest import make_tiny_target
from tests.unit.test_runtime_drafter import prompts, target, trained  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

NEW_TOKENS = 32


def _static(drafter, model, ids, new, graphs, stops=None):
    return speculate_static(drafter, model, ids, new, Sampling(), stops, None, None, NO_CLOCK, graphs=graphs)


@pytest.fixture(scope="module")
def on_gpu(target, trained):  # noqa: F811
    """The CPU tests' tiny target and trained drafter (tau about 2.4), in float32 on the GPU."""
    return copy.deepcopy(target).cuda(), copy.deepcopy(trained).cuda()


def test_graphs_give_the_eager_steps_tokens_and_lengths(on_gpu, prompts):  # noqa: F811
    model, drafter = on_gpu
    lengths = []
    for new in (NEW_TOKENS, 13):  # 13: the last blocks are cut by the budget
        for prompt in prompts:
            ids = prompt[None].cuda()
            eager = _static(drafter, model, ids, new, graphs=False)
            graphed = _static(drafter, model, ids, new, graphs=True)
            assert drafter.__dict__["_static_runtime"].greedy_step.graph is not None  # really replayed (the device loop)
            dynamic = spec_generate(drafter, model, ids, new, return_stats=True, static=False)
            assert torch.equal(graphed.output_ids, eager.output_ids)
            assert graphed.acceptance_lengths == eager.acceptance_lengths == dynamic.acceptance_lengths
            # An explicit mask: generate would otherwise mask the prompt's token 0 as padding (pad_token_id=0).
            reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)
            assert torch.equal(graphed.output_ids, reference)
            assert torch.equal(graphed.output_ids, target_generate(model, ids, new, static=True))
            lengths += graphed.acceptance_lengths
    assert sum(lengths) / len(lengths) > 1.5  # drafts are accepted: the draft graph matters


@pytest.mark.parametrize("k", [1, 2])
def test_graphs_at_a_short_verify_give_the_eager_steps_tokens_and_lengths(on_gpu, prompts, k):  # noqa: F811
    """verify_tokens=k: the verify graph reads the block's first k+1 slots, the next draft
    the k+1 features it wrote."""
    model, drafter = on_gpu
    for prompt in prompts:
        ids = prompt[None].cuda()
        eager = speculate_static(drafter, model, ids, NEW_TOKENS, Sampling(), None, None, None, NO_CLOCK, graphs=False,
                                 verify_tokens=k)
        graphed = speculate_static(drafter, model, ids, NEW_TOKENS, Sampling(), None, None, None, NO_CLOCK,
                                   graphs=True, verify_tokens=k)
        assert drafter.__dict__["_static_runtime"].greedy_step.graph is not None
        dynamic = spec_generate(drafter, model, ids, NEW_TOKENS, return_stats=True, static=False, verify_tokens=k)
        assert torch.equal(graphed.output_ids, eager.output_ids)
        assert torch.equal(graphed.output_ids, target_generate(model, ids, NEW_TOKENS))
        assert graphed.acceptance_lengths == eager.acceptance_lengths == dynamic.acceptance_lengths
        assert max(graphed.acceptance_lengths) <= k + 1


def test_graphs_reused_across_requests_and_stop_tokens(on_gpu, prompts):  # noqa: F811
    model, drafter = on_gpu
    ids = prompts[:1].cuda()
    _static(drafter, model, ids, NEW_TOKENS, graphs=True)
    runtime = drafter.__dict__["_static_runtime"]
    full = target_generate(model, ids, NEW_TOKENS)[0, ids.shape[1]:].tolist()
    stop = full[9]
    expected = target_generate(model, ids, NEW_TOKENS, stop_token_ids=[stop])
    got = _static(drafter, model, ids, NEW_TOKENS, graphs=True, stops=[stop])
    assert drafter.__dict__["_static_runtime"] is runtime
    assert torch.equal(got.output_ids, expected)


def test_plain_baseline_graph_equals_the_dynamic_loop(on_gpu, prompts):  # noqa: F811
    model, _ = on_gpu
    for prompt in prompts:
        ids = prompt[None].cuda()
        gaps_graph, gaps_eager = [], []
        graphed = target_generate(model, ids, 24, gaps_ulps=gaps_graph, static=True)
        assert model.__dict__["_static_runtime"].step.graph is not None
        assert torch.equal(graphed, target_generate(model, ids, 24, gaps_ulps=gaps_eager))
        assert gaps_graph == pytest.approx(gaps_eager, rel=1e-2, abs=1e-2)


def test_bf16_graphs_run_and_match_eager_static():
    model = make_tiny_target("llama", seed=5).to("cuda", torch.bfloat16)
    cfg = DFlashConfig.from_target(model.config, mask_token_id=96, num_hidden_layers=2, block_size=8)
    torch.manual_seed(0)
    drafter = DFlashDraftModel(cfg).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, 90, (1, 11), generator=torch.Generator().manual_seed(1)).cuda()
    eager = _static(drafter, model, ids, 40, graphs=False)
    graphed = _static(drafter, model, ids, 40, graphs=True)
    assert torch.equal(graphed.output_ids, eager.output_ids)
    assert graphed.acceptance_lengths == eager.acceptance_lengths
    assert torch.equal(spec_generate(drafter, model, ids, 40), graphed.output_ids)  # the GPU default: static


def check_compiled_draft_keeps_the_targets_tokens(drafter, model, rows, new: int, **reference) -> None:
    """eval's compile_drafter: the draft step (the kind's pick included) compiled inside the
    graphs. Drafts may move by rounding, the committed tokens may not (against
    target_generate(..., **reference)), and the drafter is still accepted."""
    drafter.compile_static_draft = True
    try:
        lengths = []
        for prompt in rows:
            ids = prompt[None].cuda()
            out = _static(drafter, model, ids, new, graphs=True)
            assert drafter.__dict__["_static_runtime"].compiled
            assert torch.equal(out.output_ids, target_generate(model, ids, new, **reference))
            lengths += out.acceptance_lengths
        assert sum(lengths) / len(lengths) > 1.5
    finally:
        drafter.compile_static_draft = False


def test_a_compiled_draft_step_keeps_the_targets_tokens(on_gpu, prompts):  # noqa: F811
    model, drafter = on_gpu
    check_compiled_draft_keeps_the_targets_tokens(drafter, model, prompts, NEW_TOKENS, static=True)
