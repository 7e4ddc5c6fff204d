"""Batched speculative decoding on the static runtime with the real SmolLM2 target (float32,
CPU): every row of a ragged chat batch is plain greedy decoding of that row alone, at three
batch sizes (tests/unit/test_static_batched.py compares acceptance lengths, with a drafter
that is accepted); eval.speed runtime=static batch_size=N prints its
table and, with step_timing=true, still the batch-1 breakdown."""

import pytest
import torch

from dflash_train.eval.acceptance import target_generate
from dflash_train.eval.static_batched import plain_static_batch, speculate_static_batch
from dflash_train.model.dflash import DFlashConfig, DFlashDraftModel, Sampling
from tests.conftest import SMOLLM2_MASK_ID

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string, with a docstring.",
    "Hi",
    "Explain photosynthesis in two sentences for a ten year old child.",
    "List three primes.",
]
NEW_TOKENS = 8  # 7 verify steps a row after the prefill (row 0's answer ends at the 8th)
BATCH_SIZES = (2, 3, 5)


@pytest.fixture(scope="module")
def rows(smollm2_tokenizer):
    return [list(smollm2_tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                       return_dict=True)["input_ids"]) for p in PROMPTS]


def test_rows_equal_plain_greedy_decoding_alone(smollm2, rows, few_static_slots):
    target = smollm2.model
    assert len({len(r) for r in rows}) == len(rows)  # every row a different length
    torch.manual_seed(0)
    drafter = DFlashDraftModel(DFlashConfig.from_target(target.config, mask_token_id=SMOLLM2_MASK_ID,
                                                        num_hidden_layers=1)).eval()
    plain = [target_generate(target, torch.tensor([r]), NEW_TOKENS)[0, len(r):].tolist() for r in rows]
    for size in BATCH_SIZES:
        outs = speculate_static_batch(drafter, target, rows[:size], NEW_TOKENS, Sampling())
        assert [out.output_ids[0, len(r):].tolist() for r, out in zip(rows, outs)] == plain[:size]
        assert all(out.num_new_tokens == 1 + sum(out.acceptance_lengths) for out in outs)
        assert plain_static_batch(target, rows[:size], NEW_TOKENS) == plain[:size]
    assert len({tuple(p) for p in plain}) == len(plain)  # distinct answers: no row copies another


def test_speed_runs_static_batches_and_keeps_the_breakdown(capsys, few_static_slots):
    from dflash_train.eval.speed import run

    summaries = run(["drafter_path=random", "drafter=cpu_small", "datasets=[mtbench]", "limit=3",
                     "max_new_tokens=4", "runtime=static", "batch_size=2", "step_timing=true",
                     "target.dtype=float32"])
    out = capsys.readouterr().out.splitlines()
    header = " ".join(line.strip() for line in out)  # the header wraps at 100 characters
    assert ", batch 2, 4 new tokens, drafter random, 7 drafts verified per step" in header  # cpu_small: block 8
    static = summaries["static"]  # 3 prompts in two batches of 2 (the first prompt twice)
    assert (static["num_prompts"], static["spec_tokens"], static["plain_tokens"]) == (4, 16, 16)
    assert static["greedy_agreement"] == 1.0 and static["speedup"] > 0
    row = next(line for line in out if line.startswith("static "))
    assert row.split()[1:2] == ["4"] and row.split()[-1] == "100.0"
    assert any(line.startswith("per speculative step, static runtime (3 prompts, ") for line in out)
