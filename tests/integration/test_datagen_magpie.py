"""Prompts written by the real SmolLM2 target (magpie source): sampled per candidate seed,
answered like any other prompt, and read back (not sampled again) by a restarted run."""

import shutil

import pytest

from data_gen.config import to_datagen_config
from data_gen.pipeline import run
from dflash_train.data.format import load_generated, read_manifest
from tests.conftest import SMOLLM2

# one thread: tiny matmuls do not split, and on a shared CPU the second thread waits
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
# What SmolLM2 writes from candidate seeds 0, 2 and 9 (the others run past 24 tokens).
FIRST = "Can you provide a detailed guide on cholesterol levels and how they can affect various medical conditions?"


def config(out_dir, batch_size):
    return to_datagen_config({
        "target": {"name": SMOLLM2}, "out_dir": str(out_dir), "shard_size": 2,
        "sources": [{"kind": "magpie", "num_prompts": 3, "max_tokens": 24}], "sampling": {"max_new_tokens": 4},
        "backend": {"kind": "hf", "batch_size": batch_size, "cpu_threads": 1}})


def test_target_writes_prompts_and_a_restart_reads_them_back(tmp_path, smollm2, smollm2_tokenizer):
    cfg = config(tmp_path / "full", batch_size=4)
    result = run(cfg, target=smollm2, tokenizer=smollm2_tokenizer, progress=False)
    data = load_generated(cfg.out_dir)
    folder = tmp_path / "full" / "prompts" / "magpie"
    # Candidates in chunks of 4 (one generate call each) until three usable ones.
    assert sorted(p.name for p in folder.iterdir()) == [
        "candidates-000000000.jsonl", "candidates-000000004.jsonl", "candidates-000000008.jsonl", "settings.json"]
    assert result.counts["skipped"] == {"truncated": 7} and result.counts["prompts"] == 3
    texts = [smollm2_tokenizer.decode(r["input_ids"][: r["prompt_len"]]) for r in data]
    assert f"<|im_start|>user\n{FIRST}<|im_end|>\n<|im_start|>assistant\n" in texts[0]
    assert set(data["source"]) == {"magpie"} and read_manifest(cfg.out_dir)["counts"]["rows"] == 3

    again = run(cfg, target=smollm2, tokenizer=smollm2_tokenizer, progress=False)
    assert again.generated_tokens == 0 and len(list(folder.iterdir())) == 4

    # As if killed after the first chunk: only it is on disk. The restart samples the rest two
    # candidates per call (batch_size=2), from the same per-candidate seeds: the same data.
    partial = tmp_path / "partial" / "prompts" / "magpie"
    partial.mkdir(parents=True)
    for name in ("settings.json", "candidates-000000000.jsonl"):
        shutil.copy(folder / name, partial / name)
    resumed = config(tmp_path / "partial", batch_size=2)
    run(resumed, target=smollm2, tokenizer=smollm2_tokenizer, progress=False)
    assert load_generated(resumed.out_dir)[:] == data[:]
    assert len(list(partial.iterdir())) == 2 + 3  # candidates 4..9, two per file


def test_a_system_prompt_steers_the_prompts_not_the_answers(tmp_path, smollm2, smollm2_tokenizer):
    """A magpie source's system_prompt: the target writes its prompts under it (other prompts
    than the unsteered run's), and answers them under the run's template (its default system
    prompt), as a served target would be asked."""
    steer = "You are a Python expert. Users ask you to write Python functions."
    cfg = to_datagen_config({
        "target": {"name": SMOLLM2}, "out_dir": str(tmp_path / "steered"), "shard_size": 2,
        "sources": [{"kind": "magpie", "num_prompts": 2, "max_tokens": 64, "system_prompt": steer}],
        "sampling": {"max_new_tokens": 4}, "backend": {"kind": "hf", "batch_size": 4, "cpu_threads": 1}})
    run(cfg, target=smollm2, tokenizer=smollm2_tokenizer, progress=False)
    texts = [smollm2_tokenizer.decode(r["input_ids"][: r["prompt_len"]]) for r in load_generated(cfg.out_dir)]
    assert len(texts) == 2 and all(steer not in t and "named SmolLM" in t for t in texts)
    assert not any(FIRST in t for t in texts)
    settings = (tmp_path / "steered" / "prompts" / "magpie" / "settings.json").read_text()
    assert steer in settings
