"""Crash safety: `kill -9` in the middle of dflash-datagen, rerun the same command, and the
result holds every prompt exactly once and equals an uninterrupted run; with every turn of
multi-turn conversations regenerated, each conversation is one row, once."""

import json
import re

import pytest
import torch

from data_gen.generators import HF_BATCHES_PER_CALL
from data_gen.pipeline import run
from dflash_train.data.format import load_generated
from tests.cli_helpers import run_cli
from tests.datagen_helpers import (
    compose_config,
    kill_after_first_shard,
    overrides,
    write_conversations,
    write_prompts,
)

pytestmark = pytest.mark.slow
NUM_PROMPTS = 6
IM_START = 1


@pytest.mark.parametrize("turns", ["one", "all"])
def test_kill_9_then_rerun_equals_uninterrupted(tmp_path, smollm2, smollm2_tokenizer, turns):
    prompts = tmp_path / "prompts.jsonl"
    # The hf generator answers HF_BATCHES_PER_CALL batches a call and commits their shards
    # one right after another at the call's end: single-turn prompts past the first call keep
    # uncommitted shards behind the kill (with 6, a fast CPU committed all six before it).
    num_prompts = HF_BATCHES_PER_CALL + 4 if turns == "one" else NUM_PROMPTS
    if turns == "one":
        write_prompts(prompts, num_prompts)
        killed = overrides(tmp_path / "killed", prompts, shard_size=1, batch_size=1)
    else:  # calls of two prompts mix turns of different conversations and shards
        write_conversations(prompts, NUM_PROMPTS)
        killed = overrides(tmp_path / "killed", prompts, shard_size=1, batch_size=2, max_new_tokens=8)
        killed.append("template.max_turns=null")
    committed = kill_after_first_shard(killed, tmp_path / "killed")
    assert 1 <= len(committed) < num_prompts and not (tmp_path / "killed" / "manifest.json").exists()

    rerun = run_cli("dflash-datagen", *killed)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert re.search(rf"rows written +{num_prompts}\n", rerun.stdout), rerun.stdout

    reference = compose_config([f"out_dir={tmp_path / 'reference'}", *killed[1:]])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the command's backend.cpu_threads=1: same kernels, same ids
    try:
        run(reference, target=smollm2, tokenizer=smollm2_tokenizer, progress=False)
    finally:
        torch.set_num_threads(threads)
    got, want = load_generated(tmp_path / "killed"), load_generated(tmp_path / "reference")
    assert len(set(got["prompt_id"])) == num_prompts
    assert got[:] == want[:]
    # A SmolLM2 row of t + 1 answered turns holds 2t + 3 <|im_start|> (system, users, answers, header)
    answered = [(row.count(IM_START) - 1) // 2 for row in got["input_ids"]]
    # (conversation 2's first answer, and 5's second, run past 8 tokens: those end there)
    assert answered == ([1] * num_prompts if turns == "one" else [1, 2, 1, 1, 2, 2])


def test_a_budget_counts_the_seconds_of_earlier_attempts(tmp_path):
    """budget.json keeps what a killed attempt spent: a rerun has only the rest."""
    from data_gen.pipeline import Budget

    (tmp_path / "budget.json").write_text(json.dumps({"seconds": 50.0, "minutes": 1.0}))
    budget = Budget(tmp_path, 1.0, rank=0)
    assert budget.left == pytest.approx(10.0) and budget.deadline == pytest.approx(budget.started + 10.0)
    assert Budget(tmp_path / "new", 2.0, rank=0).left == pytest.approx(120.0)
    budget.save()
    assert json.loads((tmp_path / "budget.json").read_text())["seconds"] == pytest.approx(50.0, abs=1.0)
