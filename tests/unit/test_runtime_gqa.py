"""The static runtime's packed grouped-query attention (`gqa="packed"`) on CPU, float32.

Packed, a K/V head's query heads are stacked as the rows of one query instead of K/V being
copied to every query head; the scores and softmax rows are the same, so the verify's logits
and features equal the repeat path's, and greedy decoding stays plain decoding, with the
same acceptance length at every step, for a drafter that really is accepted.
"""

import pytest
import torch

from dflash_train.model.runtime import StaticSpeculator, TargetSlots
from tests.conftest import make_tiny_target
from tests.unit.test_runtime_drafter import (  # noqa: F401 (fixtures)
    NEW_TOKENS,
    prompts,
    target,
    trained,
)

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 1e-5  # float32; on the CPUs tried the two paths agree to the bit


def test_packed_verify_equals_repeat_for_every_row_and_width(target, trained):  # noqa: F811
    ids = torch.randint(0, 90, (3, 20), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(20).repeat(3, 1)
    outs = {}
    for gqa in ("repeat", "packed"):
        slots = TargetSlots(target, 64, width=5, layer_ids=trained.target_layer_ids, graphs=False, rows=3, gqa=gqa)
        prefill = slots.forward(ids[:, :12], positions[:, :12])  # 12 tokens a row, then a 5-wide step, then 3
        step = slots.forward(ids[:, 12:17], positions[:, 12:17])
        last = slots.forward(ids[:, 17:], positions[:, 17:])
        outs[gqa] = [t for out in (prefill, step, last) for t in out]
    assert target.config._attn_implementation == "sdpa"  # put back after every packed forward
    for repeat, packed in zip(outs["repeat"], outs["packed"]):
        torch.testing.assert_close(packed, repeat, rtol=0, atol=ATOL)


def greedy_run(drafter, target, ids, new_tokens: int, gqa: str, verify_tokens=None):  # noqa: F811
    """The greedy device loop (`speculate_static`'s) on a runtime built with ``gqa``."""
    prompt_len = ids.shape[1]
    rt = StaticSpeculator(drafter, target, 64, graphs=False, verify_tokens=verify_tokens, gqa=gqa)
    logits, feats = rt.verifier.prefill(ids, logits_to_keep=1)
    end = prompt_len + new_tokens - 1
    rt.begin(logits[:, -1].argmax(-1), torch.tensor([[prompt_len]]), torch.tensor([[end]]), drafter.mask_token_id, [])
    rt.run_greedy((feats, torch.arange(prompt_len)[None]))
    return rt.results()[0]


@pytest.mark.parametrize("verify_tokens", [None, 2])
def test_packed_greedy_is_plain_decoding_step_by_step(target, prompts, trained, verify_tokens):  # noqa: F811
    accepted = 0
    with torch.inference_mode():
        for prompt in prompts:
            ids = prompt[None]
            plain = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                    do_sample=False)[0, ids.shape[1]:].tolist()
            tokens, lengths = greedy_run(trained, target, ids, NEW_TOKENS, "packed", verify_tokens)
            assert tokens == plain
            assert (tokens, lengths) == greedy_run(trained, target, ids, NEW_TOKENS, "repeat", verify_tokens)
            accepted += NEW_TOKENS - len(lengths)
    assert accepted > len(prompts) * 4  # the drafter is accepted: the verify's drafts decide the steps


def test_gqa_path_is_checked():
    tiny = make_tiny_target("qwen3", layers=1)
    with pytest.raises(ValueError, match="gqa='stacked': must be one of"):
        TargetSlots(tiny, 8, width=1, gqa="stacked")
    eager = make_tiny_target("qwen3", layers=1, attn_implementation="eager")
    with pytest.raises(ValueError, match="attention is 'eager'"):
        TargetSlots(eager, 8, width=1, gqa="packed")
