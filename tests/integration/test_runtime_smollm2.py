"""Contract section 3 with the real SmolLM2 target: speculative greedy decoding is lossless."""

import pytest
import torch

from dflash_train.eval.acceptance import target_generate
from dflash_train.model.dflash import DFlashConfig, DFlashDraftModel
from dflash_train.model.runtime import spec_generate
from tests.conftest import SMOLLM2_MASK_ID

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain photosynthesis in two sentences.",
    "List three prime numbers greater than 10.",
    "How do I make a cup of tea?",
]
NEW_TOKENS = 40
RANDOM_PROMPTS = 3  # the random drafter's dynamic decodes: the first three prompts (117 verify steps)


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    return [smollm2_tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                  return_tensors="pt", return_dict=True)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def plain(smollm2, prompts):
    return [_generate(smollm2.model, ids, NEW_TOKENS, eos=None) for ids in prompts]


@pytest.fixture(scope="module")
def random_dynamic(smollm2, prompts):
    """The random drafter's decodes of the first RANDOM_PROMPTS prompts on the dynamic runtime
    (CPU's default), shared by the two tests that check them: each costs about 8-10 s."""
    drafter = _random_drafter(smollm2.model)
    return [spec_generate(drafter, smollm2.model, ids, NEW_TOKENS, return_stats=True, static=False)
            for ids in prompts[:RANDOM_PROMPTS]]


def _generate(model, ids, new, eos):
    # SmolLM2's pad id equals <|im_end|>, which the chat prompt contains: without an explicit
    # all-ones attention mask, generate() would mask those prompt tokens out.
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                          eos_token_id=eos)


def _random_drafter(target):
    torch.manual_seed(0)
    return DFlashDraftModel(DFlashConfig.from_target(target.config, mask_token_id=SMOLLM2_MASK_ID)).eval()


class OracleDrafter(DFlashDraftModel):
    """Drafts the target's own greedy continuation: every block is correct (tau near B)."""

    def set_answer(self, ids: torch.Tensor):
        self.answer = ids[0]

    def propose(self, target, anchor, n, room, new_features, start, cache, mask_id, sampling, generator):
        # the reference loop's drafts of the block at `start` (greedy): the answer's next n tokens
        drafts = torch.zeros(n, dtype=torch.long)
        wanted = self.answer[start + 1 : start + 1 + n]
        drafts[: wanted.numel()] = wanted
        return drafts, None


def test_random_drafter_is_lossless_with_tau_near_one(plain, random_dynamic):
    taus = []
    assert len(random_dynamic) == RANDOM_PROMPTS
    for out, expected in zip(random_dynamic, plain):
        assert torch.equal(out.output_ids, expected)
        assert sum(out.acceptance_lengths) == NEW_TOKENS - 1  # the first token comes from the prefill
        taus.append(sum(out.acceptance_lengths) / len(out.acceptance_lengths))
    assert 1.0 <= sum(taus) / len(taus) < 1.2


def test_static_runtime_equals_plain_and_the_dynamic_runtime(smollm2, prompts, plain, random_dynamic, few_static_slots):
    """The static runtime (slot caches, B-wide blocks masked by position) on the real target:
    plain decoding's tokens, and the dynamic runtime's acceptance length at every step."""
    drafter = _random_drafter(smollm2.model)
    # Two prompts: the step-by-step equality on every prompt is the unit tests' (tiny targets).
    for ids, expected, dynamic in list(zip(prompts, plain, random_dynamic))[:2]:
        static = spec_generate(drafter, smollm2.model, ids, NEW_TOKENS, return_stats=True, static=True)
        assert torch.equal(static.output_ids, expected)
        assert static.acceptance_lengths == dynamic.acceptance_lengths
        assert torch.equal(target_generate(smollm2.model, ids, NEW_TOKENS, static=True), expected)


def test_forced_correct_drafter_is_lossless_with_tau_near_block_size(smollm2, prompts, plain):
    drafter = OracleDrafter(DFlashConfig.from_target(smollm2.config, mask_token_id=SMOLLM2_MASK_ID)).eval()
    for ids, expected in zip(prompts, plain):
        drafter.set_answer(expected)
        out = drafter.spec_generate(smollm2.model, ids, NEW_TOKENS, return_stats=True)
        assert torch.equal(out.output_ids, expected)
        # 39 tokens after the prefill: blocks of 16, 16, then the 7 that remain
        assert out.acceptance_lengths == [16, 16, 7]


def test_stop_tokens_end_generation_like_plain_decoding(smollm2, smollm2_tokenizer, prompts, few_static_slots):
    drafter = _random_drafter(smollm2.model)
    eos = smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = prompts[0]
    expected = _generate(smollm2.model, ids, 200, eos)
    assert expected[0, -1] == eos and expected.shape[1] - ids.shape[1] < 200  # it really stops early
    for static in (False, True):
        got = spec_generate(drafter, smollm2.model, ids, 200, stop_token_ids=[eos], static=static)
        assert torch.equal(got, expected)
