"""The static runtime on CPU: the same step functions a GPU captures as CUDA graphs, run eagerly.

Its blocks are always B wide and its caches are slot buffers masked by position, so what it
must reproduce is the dynamic runtime's arithmetic: the same greedy tokens (plain decoding's),
the same acceptance length at every step, and the same drafter outputs on the slots the budget
can use, for a drafter that really is accepted (tau well above 1) and for a sliding one.
"""

import pytest
import torch

from dflash_train.eval.acceptance import target_generate
from dflash_train.model.dflash import DFlashConfig, DFlashDraftModel
from dflash_train.model.runtime import MIN_SLOTS, StaticSpeculator, spec_generate, static_unsupported
from tests.conftest import make_tiny_target
from tests.unit.test_runtime_drafter import (  # noqa: F401 (fixtures)
    BLOCK,
    DRAFTERS,
    MASK_ID,
    prompts,
    target,
    tiny_drafter,
    trained,
)

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 1e-5  # float32: the masked B-wide block and the narrowed one differ by rounding only


def test_greedy_equals_plain_and_the_dynamic_runtime_on_tiny_targets():
    for arch in ("llama", "qwen2", "qwen3"):
        tiny = make_tiny_target(arch)
        cfg = DFlashConfig.from_target(tiny.config, mask_token_id=96, num_hidden_layers=2, block_size=5)
        drafter = DFlashDraftModel(cfg).eval()
        ids = torch.randint(0, 90, (1, 7), generator=torch.Generator().manual_seed(2))
        for new in (1, 2, 9, 23):
            static = spec_generate(drafter, tiny, ids, new, return_stats=True, static=True)
            dynamic = spec_generate(drafter, tiny, ids, new, return_stats=True, static=False)
            assert torch.equal(static.output_ids, tiny.generate(ids, max_new_tokens=new, do_sample=False))
            assert static.acceptance_lengths == dynamic.acceptance_lengths
            assert static.num_new_tokens == new


def record_draft_outputs(monkeypatch, drafter):
    """Each draft step's drafter outputs (B, H) from both runtimes, keyed by runtime."""
    steps = {"static": [], "dynamic": []}
    static_draft, dynamic_draft = StaticSpeculator.draft_hidden, drafter.draft_hidden

    def static_recording(self, feats, ctx_pos):
        hidden = static_draft(self, feats, ctx_pos)
        # the device loop drafts even where the budget leaves no draft slot, and may run steps
        # past the end: those draft nothing that counts
        if not self.done.all() and int(self.end[0, 0] - self.block_pos[0, 0]) > 1:
            steps["static"].append((int(self.block_pos[0, 0]), hidden[0].clone()))
        return hidden

    def dynamic_recording(model, block_ids, new_features, start, cache):
        hidden = dynamic_draft(model, block_ids, new_features, start, cache)
        steps["dynamic"].append((start, hidden[0].clone()))
        return hidden

    monkeypatch.setattr(StaticSpeculator, "draft_hidden", static_recording)
    monkeypatch.setattr(drafter, "draft_hidden", dynamic_recording)
    return steps


@pytest.mark.parametrize("which", list(DRAFTERS))
@pytest.mark.parametrize("new_tokens", [32, 13])
def test_every_step_equals_the_dynamic_runtime(monkeypatch, target, prompts, trained,  # noqa: F811
                                               which, new_tokens):
    drafter = trained if DRAFTERS[which] is None else tiny_drafter(target, seed=6, **DRAFTERS[which])
    lengths = []
    for prompt in prompts:
        ids = prompt[None]
        steps = record_draft_outputs(monkeypatch, drafter)
        static = spec_generate(drafter, target, ids, new_tokens, return_stats=True, static=True)
        dynamic = spec_generate(drafter, target, ids, new_tokens, return_stats=True, static=False)
        monkeypatch.undo()
        plain = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
        assert torch.equal(static.output_ids, plain) and torch.equal(dynamic.output_ids, plain)
        assert static.acceptance_lengths == dynamic.acceptance_lengths
        # the same steps at the same anchors; on the slots the budget can use, the same outputs
        assert [s for s, _ in steps["static"]] == [s for s, _ in steps["dynamic"]]
        for (start, ours), (_, theirs) in zip(steps["static"], steps["dynamic"]):
            torch.testing.assert_close(ours[: len(theirs)], theirs, atol=ATOL, rtol=1e-5,
                                       msg=lambda m, start=start: f"draft step at start={start}: {m}")
        lengths += static.acceptance_lengths
    if which == "trained":  # the comparison has power: drafts are accepted, steps of several lengths
        assert sum(lengths) / len(lengths) > 1.5 and max(lengths) == BLOCK and min(lengths) < BLOCK


def test_stop_tokens_end_like_plain_decoding(target, prompts, trained):  # noqa: F811
    ids = prompts[:1]
    full = target_generate(target, ids, 32)[0, ids.shape[1]:].tolist()
    stop = full[9]  # a token the answer really emits, mid-block for some step
    expected = target_generate(target, ids, 32, stop_token_ids=[stop])
    assert expected.shape[1] < ids.shape[1] + 32
    static = spec_generate(trained, target, ids, 32, stop_token_ids=[stop], return_stats=True, static=True)
    dynamic = spec_generate(trained, target, ids, 32, stop_token_ids=[stop], return_stats=True, static=False)
    assert torch.equal(static.output_ids, expected)
    assert static.acceptance_lengths == dynamic.acceptance_lengths


def test_runtime_is_reused_and_stale_slots_stay_hidden(target, trained):  # noqa: F811
    """A longer earlier request leaves its K/V in slots a shorter one never writes: the mask
    by position must hide them. A request that needs more slots gets a bigger runtime."""
    long_ids = torch.randint(0, 90, (1, 40), generator=torch.Generator().manual_seed(8))
    short_ids = long_ids[:, 30:36]
    spec_generate(trained, target, long_ids, 24, static=True)
    runtime = trained.__dict__["_static_runtime"]
    assert runtime.verifier.cache.size == MIN_SLOTS
    got = spec_generate(trained, target, short_ids, 24, static=True)
    assert trained.__dict__["_static_runtime"] is runtime
    assert torch.equal(got, target_generate(target, short_ids, 24))
    huge = torch.randint(0, 90, (1, MIN_SLOTS), generator=torch.Generator().manual_seed(9))
    got = spec_generate(trained, target, huge, 5, static=True)
    assert trained.__dict__["_static_runtime"].verifier.cache.size == 2 * MIN_SLOTS
    assert torch.equal(got, target_generate(target, huge, 5))


def test_plain_static_decoding_equals_dynamic(target, prompts):  # noqa: F811
    for prompt in prompts:
        ids = prompt[None]
        gaps_static, gaps_dynamic = [], []
        static = target_generate(target, ids, 20, gaps_ulps=gaps_static, static=True)
        assert torch.equal(static, target_generate(target, ids, 20, gaps_ulps=gaps_dynamic))
        assert gaps_static == pytest.approx(gaps_dynamic, rel=1e-3, abs=1e-3)
        stop = static[0, ids.shape[1] + 4].item()
        expected = target_generate(target, ids, 20, stop_token_ids=[stop])
        assert torch.equal(target_generate(target, ids, 20, stop_token_ids=[stop], static=True), expected)


def test_static_refuses_targets_it_cannot_serve():
    sliding = make_tiny_target("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert "layer types" in static_unsupported(sliding)
    drafter = DFlashDraftModel(DFlashConfig.from_target(sliding.config, mask_token_id=MASK_ID, block_size=4)).eval()
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="static=True cannot serve this target: layer types"):
        spec_generate(drafter, sliding, ids, 4, static=True)
    # unspecified: static on a GPU only; the CPU and an unsupported target get the dynamic runtime
    assert torch.equal(spec_generate(drafter, sliding, ids, 4), spec_generate(drafter, sliding, ids, 4, static=False))
    assert "_static_runtime" not in drafter.__dict__
    assert static_unsupported(make_tiny_target("llama")) is None
