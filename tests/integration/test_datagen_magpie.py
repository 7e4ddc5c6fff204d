"""Prompts written by the real SmolLM2 target (magpie source): sampled per candidate seed,
answered like any other prompt, and read back (not sampled again) by a restarted run."""

import json
import shutil

import pytest

import data_gen.generators
from data_gen.config import SamplingConfig, to_datagen_config
from data_gen.hf_generator import HFGenerator
from data_gen.magpie import user_prefix
from data_gen.pipeline import run
from data_gen.template import ChatShaper
from dflash_train.contract import derive_seed
from dflash_train.data.format import load_generated, read_manifest
from tests.conftest import SMOLLM2
from tests.datagen_helpers import an_hour_after_each_batch, write_prompts

# one thread: tiny matmuls do not split, and on a shared CPU the second thread waits
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
# What SmolLM2 writes from candidate seed 1, the first of those (1, 2 and 7 of the first eight)
# that end their user turn within 24 tokens (sampler v2: the CDF in token order).
FIRST = "Can you suggest a DIY project that could help reduce energy consumption while improving mental health?"
IM_END = 2  # <|im_end|>: SmolLM2's end of a turn, a user's as an assistant's


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
    # Candidates in chunks until three usable ones: 3 (as many as the prompts missing), then 2
    # (1 missing over 2 usable of 3 read, a tenth more), then 3 (1 over 2 of 5).
    assert sorted(p.name for p in folder.iterdir()) == [
        "candidates-000000000.jsonl", "candidates-000000003.jsonl", "candidates-000000005.jsonl", "settings.json"]
    assert result.counts["skipped"] == {"truncated": 5} and result.counts["prompts"] == 3
    stored = [json.loads(line) for f in sorted(folder.glob("candidates-*")) for line in f.read_text().splitlines()]
    assert [r["finish_reason"] == "stop" for r in stored] == [i in (1, 2, 7) for i in range(8)]
    # Written: 8 candidates; read: 8 (3 kept, 5 truncated); none unused.
    tokens = [r["num_tokens"] for r in stored]
    kept = tokens[1] + tokens[2] + tokens[7]
    assert result.counts["magpie"] == read_manifest(cfg.out_dir)["counts"]["magpie"] == {"magpie": {
        "candidates": 8, "kept": 3, "dropped": {"truncated": 5}, "unused": 0, "stopped_by_budget": False,
        "tokens": sum(tokens), "tokens_kept": kept, "tokens_dropped": 5 * 24, "tokens_truncated": 5 * 24,
        "tokens_unused": 0, "waste": round(1 - kept / sum(tokens), 4)}}
    assert sum(tokens) == kept + 5 * 24
    assert all(n == 24 for r, n in zip(stored, tokens) if r["finish_reason"] == "length")
    texts = [smollm2_tokenizer.decode(r["input_ids"][: r["prompt_len"]]) for r in data]
    assert f"<|im_start|>user\n{FIRST}<|im_end|>\n<|im_start|>assistant\n" in texts[0]
    assert set(data["source"]) == {"magpie"} and read_manifest(cfg.out_dir)["counts"]["rows"] == 3

    # the summary's seconds: writing the candidates is part of the prompts' (the target came loaded)
    assert 0 < result.magpie_s < result.prompts_s and result.load_s == 0

    again = run(cfg, target=smollm2, tokenizer=smollm2_tokenizer, progress=False)
    assert again.generated_tokens == 0 and len(list(folder.iterdir())) == 4 and again.magpie_s == 0

    # As if killed after the first chunk: only it is on disk. The restart sizes its chunks by the
    # usable share so far (2 of 3 read: 2 candidates for the one prompt missing, then 2 of 5: 3)
    # at two candidates per call (batch_size=2), from the same per-candidate seeds: the same data.
    partial = tmp_path / "partial" / "prompts" / "magpie"
    partial.mkdir(parents=True)
    for name in ("settings.json", "candidates-000000000.jsonl"):
        shutil.copy(folder / name, partial / name)
    resumed = config(tmp_path / "partial", batch_size=2)
    run(resumed, target=smollm2, tokenizer=smollm2_tokenizer, progress=False)
    assert load_generated(resumed.out_dir)[:] == data[:]
    assert sorted(p.name for p in partial.iterdir()) == [
        "candidates-000000000.jsonl", "candidates-000000003.jsonl", "candidates-000000005.jsonl", "settings.json"]


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


def test_a_candidate_stops_at_the_end_of_its_user_turn(tmp_path, smollm2, smollm2_tokenizer):
    """The writer's candidates are the target's continuations of the user prefix cut at their
    first <|im_end|>: a stored candidate's text is what came before it, its token count
    includes it; a candidate without one within max_tokens is all 24 tokens, `length`."""
    cfg = config(tmp_path / "out", batch_size=4)
    run(cfg, target=smollm2, tokenizer=smollm2_tokenizer, progress=False)
    stored = [json.loads(line) for f in sorted((tmp_path / "out" / "prompts" / "magpie").glob("candidates-*"))
              for line in f.read_text().splitlines()][:4]
    shaper = ChatShaper(smollm2_tokenizer, [IM_END])
    prefix = smollm2_tokenizer(user_prefix(shaper), add_special_tokens=False)["input_ids"]
    # The reference: plain sampled generation of 40 tokens from each candidate's seed, not stopped.
    plain = HFGenerator(smollm2, cfg.backend, SamplingConfig(max_new_tokens=40, temperature=1.0, seed=0), [0], IM_END)
    seeds = [derive_seed(0, "magpie", "magpie", i, digest=data_gen.generators.SEED_DIGEST) for i in range(4)]
    for r, full in zip(stored, plain.generate([prefix] * 4, seeds)):
        ended = IM_END in full.ids[:24]
        ids = full.ids[: full.ids.index(IM_END) + 1] if ended else full.ids[:24]
        assert (r["finish_reason"], r["num_tokens"]) == ("stop" if ended else "length", len(ids))
        assert r["text"] == smollm2_tokenizer.decode(ids[:-1] if ended else ids).strip()
    assert [r["finish_reason"] for r in stored] == ["length", "stop", "stop", "length"]


def test_the_budget_covers_writing_prompts_and_a_cut_keeps_them_final(tmp_path, smollm2, smollm2_tokenizer,
                                                                        monkeypatch):
    """budget_min counts from the loaded target, magpie writing included: it runs out after
    the first batch of candidates (two of a call of three): the two are stored, the third is
    never written, and no prompt is answered. A rerun reads the same prompts; one with more
    minutes answers them, and never writes more candidates."""
    first_batch = an_hour_after_each_batch(monkeypatch)
    write_prompts(tmp_path / "prompts.jsonl", 2)

    def config(minutes):
        return to_datagen_config({
            "target": {"name": SMOLLM2}, "out_dir": str(tmp_path / "out"), "shard_size": 2, "exclude_eval": [],
            "sources": [{"kind": "jsonl", "path": str(tmp_path / "prompts.jsonl")},
                        {"kind": "magpie", "num_prompts": 3, "max_tokens": 24}],
            "sampling": {"max_new_tokens": 4}, "budget_min": minutes,
            "backend": {"kind": "hf", "batch_size": 2, "cpu_threads": 1}})

    folder = tmp_path / "out" / "prompts" / "magpie"
    result = run(config(1.0), target=smollm2, tokenizer=smollm2_tokenizer, progress=False)
    assert sorted(p.name for p in folder.iterdir()) == ["candidates-000000000.jsonl", "closed.json", "settings.json"]
    assert json.loads((folder / "closed.json").read_text()) == {"candidates": 2, "reason": "budget"}
    report = result.counts["magpie"]["magpie"]
    assert (report["candidates"], report["kept"], report["dropped"], report["stopped_by_budget"]) == \
        (2, 1, {"truncated": 1}, True)
    assert result.counts["prompts"] == 3 and result.counts["rows"] == 0 and result.budget_reached
    assert json.loads((tmp_path / "out" / "budget.json").read_text())["seconds"] == pytest.approx(3600.0)

    again = run(config(1.0), target=smollm2, tokenizer=smollm2_tokenizer, progress=False)
    assert again.counts["magpie"] == result.counts["magpie"] and again.generated_tokens == 0

    monkeypatch.setattr(HFGenerator, "_batch", first_batch)
    more = run(config(120.0), target=smollm2, tokenizer=smollm2_tokenizer, progress=False)
    assert more.complete and more.counts["rows"] == 3 and more.counts["magpie"] == result.counts["magpie"]
    texts = [smollm2_tokenizer.decode(r["input_ids"][: r["prompt_len"]]) for r in load_generated(more.out_dir)]
    # the prompts start mixed (pipeline.interleave): the jsonl's two with the magpie one between them
    assert f"<|im_start|>user\n{FIRST}<|im_end|>" in texts[1]
    assert sorted(p.name for p in folder.iterdir()) == ["candidates-000000000.jsonl", "closed.json", "settings.json"]
