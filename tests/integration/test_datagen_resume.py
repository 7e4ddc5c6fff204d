"""Crash safety: `kill -9` in the middle of dflash-datagen, rerun the same command, and the
result holds every prompt exactly once and equals an uninterrupted run; with every turn of
multi-turn conversations regenerated, each conversation is one row, once."""

import re
import subprocess

import pytest
import torch

from data_gen.pipeline import run
from dflash_train.data.format import load_generated
from tests.datagen_helpers import (
    cli,
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
    if turns == "one":
        write_prompts(prompts, NUM_PROMPTS)
        killed = overrides(tmp_path / "killed", prompts, shard_size=1, batch_size=1)
    else:  # calls of two prompts mix turns of different conversations and shards
        write_conversations(prompts, NUM_PROMPTS)
        killed = overrides(tmp_path / "killed", prompts, shard_size=1, batch_size=2, max_new_tokens=8)
        killed.append("template.max_turns=null")
    committed = kill_after_first_shard(killed, tmp_path / "killed")
    assert 1 <= len(committed) < NUM_PROMPTS and not (tmp_path / "killed" / "manifest.json").exists()

    rerun = subprocess.run(cli(killed), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert re.search(rf"rows written +{NUM_PROMPTS}\n", rerun.stdout), rerun.stdout

    reference = compose_config([f"out_dir={tmp_path / 'reference'}", *killed[1:]])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the command's backend.cpu_threads=1: same kernels, same ids
    try:
        run(reference, target=smollm2, tokenizer=smollm2_tokenizer, progress=False)
    finally:
        torch.set_num_threads(threads)
    got, want = load_generated(tmp_path / "killed"), load_generated(tmp_path / "reference")
    assert len(set(got["prompt_id"])) == NUM_PROMPTS
    assert got[:] == want[:]
    # A SmolLM2 row of t + 1 answered turns holds 2t + 3 <|im_start|> (system, users, answers, header)
    answered = [(row.count(IM_START) - 1) // 2 for row in got["input_ids"]]
    # (conversation 2's first answer, and 5's second, run past 8 tokens: those end there)
    assert answered == ([1] * NUM_PROMPTS if turns == "one" else [1, 2, 1, 1, 2, 2])
