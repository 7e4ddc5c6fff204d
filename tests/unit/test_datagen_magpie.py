"""Magpie sources (prompts written by the target): the template prefix they start from, and
the filters on stored candidates, with the real SmolLM2 tokenizer and template."""

import json
from pathlib import Path

import pytest

from data_gen.config import to_datagen_config
from data_gen.generators import trim_response
from data_gen.magpie import MagpieWriter, user_prefix, user_turn_stop_ids
from data_gen.pipeline import setup
from data_gen.template import ChatShaper
from dflash_train.data.prompts import load_benchmark
from dflash_train.model.target import stop_token_ids, target_identity
from tests.conftest import SMOLLM2

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
SMOL_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


def test_prefix_keeps_the_system_prompt_and_stops_at_the_user_content(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert user_prefix(ChatShaper(tok, [2])) == SMOL_SYSTEM + "<|im_start|>user\n"
    assert user_prefix(ChatShaper(tok, [2], system_prompt="Ask about cooking.")) == \
        "<|im_start|>system\nAsk about cooking.<|im_end|>\n<|im_start|>user\n"
    # A source's own system prompt steers what the target writes, whatever the run's is.
    steered = "<|im_start|>system\nUsers ask you coding questions.<|im_end|>\n<|im_start|>user\n"
    assert user_prefix(ChatShaper(tok, [2]), "Users ask you coding questions.") == steered
    assert user_prefix(ChatShaper(tok, [2], system_prompt="Ask about cooking."), "Users ask you coding questions.") \
        == steered
    # Qwen3's thinking switch shapes the answers' prompts, not the user turn the target writes.
    qwen3 = ChatShaper(tok, [2], enable_thinking=False, chat_template=str(TEMPLATES / "qwen3.jinja"))
    assert user_prefix(qwen3) == "<|im_start|>user\n"
    ids, mask = qwen3.prompt(None, ["Why is the sky blue?"], [])
    assert tok.decode(ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and sum(mask) == 0



def test_a_written_user_turn_stops_where_the_template_ends_a_user_message(smollm2_tokenizer):
    """SmolLM2 (and Qwen) end a user turn with the answer's stop token <|im_end|> (2) and open
    every turn with <|im_start|> (1); a template that closes a user turn with another special
    token adds that one too (<file_sep>, 5, after a space); plain-text turns add nothing (no
    token to stop at)."""
    tok = smollm2_tokenizer
    assert user_turn_stop_ids(ChatShaper(tok, [2])) == [2, 1]
    assert user_turn_stop_ids(ChatShaper(tok, [2, 0])) == [2, 0, 1]
    assert user_turn_stop_ids(ChatShaper(tok, [2], chat_template=str(TEMPLATES / "qwen2_5.jinja"))) == [2, 1]
    tagged = ChatShaper(tok, [2], chat_template=str(TEMPLATES / "user_tag.jinja"))
    assert user_turn_stop_ids(tagged) == [2, 5, 1] and tok.convert_ids_to_tokens([5, 1]) == ["<file_sep>", "<|im_start|>"]
    assert user_turn_stop_ids(ChatShaper(tok, [2], chat_template=str(TEMPLATES / "plain_text.jinja"))) == [2]


# Real SmolLM2 token sequences a target may write after the user prefix, and the candidate
# each one becomes (text, finish_reason, num_tokens): ended by <|im_end|> (2); by <|im_start|>
# (1), another turn opened without closing this one; by "<|im_start|>" spelled in nine plain
# pieces (what the template would tokenize back to the tag); and cut at max_tokens.
WRITTEN = [
    ([2020, 536, 25157, 746, 47, 2], ("How do magnets work?", "stop", 6)),
    ([2020, 536, 25157, 746, 47, 1, 520, 9531, 198, 34017, 1175], ("How do magnets work?", "stop", 6)),
    ([4898, 15137, 108, 306, 79, 3738, 108, 46, 4093], ("Why?", "stop", 9)),
    ([2020, 536, 25157], ("How do magnets", "length", 3)),
]


def test_a_candidate_ends_at_its_user_turn_and_never_holds_another(tmp_path, smollm2_tokenizer):
    """The generators cut a candidate after its first user-turn stop id (trim_response, as
    they do); the writer keeps the text before the stop, or before a stop tag spelled in
    pieces, and counts every token written. A kept prompt, rendered for its answer, opens
    exactly the template's three turns (system, user, assistant)."""
    tok = smollm2_tokenizer
    cfg = config(tmp_path / "out", 3)
    shaper = ChatShaper(tok, stop_token_ids(tok))
    writer = MagpieWriter(cfg.sources[0], shaper, Path(cfg.out_dir), 0, target_identity(SMOLLM2), None)
    assert writer.settings["stop_token_ids"] == [2, 1]
    assert tok.decode(WRITTEN[2][0]) == "Why?<|im_start|>user" and 1 not in WRITTEN[2][0]
    records = [writer._record(i, trim_response(ids, writer.stop_ids)) for i, (ids, _) in enumerate(WRITTEN)]
    assert [(r["text"], r["finish_reason"], r["num_tokens"]) for r in records] == [want for _, want in WRITTEN]
    for r in records[:3]:
        ids, _ = shaper.prompt(None, [r["text"]], [])
        assert ids.count(1) == 3 and tok.decode(ids).endswith(f"user\n{r['text']}<|im_end|>\n<|im_start|>assistant\n")


def config(out_dir, num_prompts, **overrides):
    cfg = {"target": {"name": SMOLLM2}, "out_dir": str(out_dir), "max_prompt_len": 64,
           "sources": [{"kind": "magpie", "num_prompts": num_prompts, "max_tokens": 24}], **overrides}
    return to_datagen_config(cfg)


def store(cfg, tokenizer, chunks: list[list[tuple[str, str]]]):
    """Candidate files as a magpie run writes them: (text, finish_reason) per candidate;
    candidate i took i + 1 tokens."""
    src = cfg.sources[0]
    writer = MagpieWriter(src, ChatShaper(tokenizer, stop_token_ids(tokenizer)), Path(cfg.out_dir),
                          cfg.sampling.seed, target_identity(SMOLLM2), None)
    writer.folder.mkdir(parents=True)
    (writer.folder / "settings.json").write_text(json.dumps(writer.settings))
    start = 0
    for chunk in chunks:
        lines = [json.dumps({"index": start + i, "text": t, "finish_reason": f, "num_tokens": start + i + 1})
                 for i, (t, f) in enumerate(chunk)]
        (writer.folder / f"candidates-{start:09d}.jsonl").write_text("\n".join(lines) + "\n")
        start += len(chunk)


def candidates():
    mtbench = load_benchmark("mtbench", limit=1)[0].turns[0]
    return [[("Write a poem about the sea.", "stop"), ("", "stop"), ("Write a poem  about the sea. ", "stop"),
             ("A question cut off at", "length"), (mtbench, "stop"), ("word " * 80, "stop"),
             ("How do magnets work?", "stop")],
            [("Explain recursion.", "stop"), ("Name three rivers.", "stop")]]


@pytest.mark.parametrize("num_prompts, kept, kept_tokens, unused", [(3, 3, 1 + 7 + 8, 1), (5, 4, 1 + 7 + 8 + 9, 0)])
def test_filters_drop_empty_duplicate_truncated_eval_and_too_long(tmp_path, monkeypatch, smollm2_tokenizer, num_prompts,
                                                                 kept, kept_tokens, unused):
    """Reading stops at num_prompts usable prompts; with more asked than stored, at the last
    stored candidate (a rank other than 0 never samples); each chunk read is primed first (its
    usable candidates). The report counts candidates and
    their tokens: kept (0, 6, 7, 8), dropped (1 to 5, 20 tokens; the truncated 3, 4 tokens),
    stored but never read; the waste is the share of all tokens not in a kept prompt."""
    cfg = config(tmp_path / "out", num_prompts)
    store(cfg, smollm2_tokenizer, candidates())
    primed = []  # each chunk read hands its usable candidates to the shaper's prime first
    monkeypatch.setattr(ChatShaper, "prime", lambda self, firsts: primed.append(firsts))
    _, _, _, _, prompts, skips = setup(cfg, smollm2_tokenizer)
    chunks = [[(None, t) for t, finish in chunk if finish == "stop"] for chunk in candidates()]
    assert primed == chunks
    texts = ["Write a poem about the sea.", "How do magnets work?", "Explain recursion.", "Name three rivers."]
    assert [p.user_turns for p in prompts] == [(t,) for t in texts[:kept]]
    assert {(p.source, p.system) for p in prompts} == {("magpie", None)}
    assert dict(skips.counts) == {"empty": 1, "duplicate": 1, "truncated": 1, "eval_overlap": 1, "too_long": 1}
    assert skips.examples["truncated"] == ["magpie candidate 3: no end of its user turn within max_tokens=24"]
    assert skips.reports == {"magpie": {
        "candidates": 9, "kept": kept, "unused": unused, "stopped_by_budget": False,
        "dropped": {"duplicate": 1, "empty": 1, "eval_overlap": 1, "too_long": 1, "truncated": 1},
        "tokens": 45, "tokens_kept": kept_tokens, "tokens_dropped": 20, "tokens_truncated": 4,
        "tokens_unused": 45 - kept_tokens - 20, "waste": round((45 - kept_tokens) / 45, 4)}}


def test_stored_prompts_of_other_settings_are_refused(tmp_path, smollm2_tokenizer):
    cfg = config(tmp_path / "out", 3)
    store(cfg, smollm2_tokenizer, candidates())
    other = config(tmp_path / "out", 3, template={"system_prompt": "Ask about cooking."})
    with pytest.raises(ValueError, match=r"prompts/magpie' holds prompts made with prefix="):
        setup(other, smollm2_tokenizer)


def test_the_summary_shows_what_the_magpie_prompts_cost():
    from data_gen.cli import format_summary
    from data_gen.pipeline import RunResult

    report = {"candidates": 12, "kept": 3, "dropped": {"duplicate": 1, "truncated": 7}, "unused": 1,
              "tokens": 200, "tokens_kept": 40, "tokens_dropped": 150, "tokens_truncated": 120, "tokens_unused": 10,
              "waste": 0.8, "stopped_by_budget": True}
    counts = {"prompts": 3, "rows": 0, "tokens": 0, "response_tokens": 0, "retokenized": 0, "finish_reasons": {},
              "ended_early": {}, "skipped": {"duplicate": 1, "truncated": 7}, "skipped_examples": {},
              "magpie": {"magpie": report}}
    lines = format_summary(RunResult("out", counts, 0.0, 0, 1.0, False, True, 3)).splitlines()
    start = lines.index("  magpie magpie: 12 candidates written, 3 kept, 8 dropped (duplicate 1, truncated 7), 1 unused")
    assert lines[start + 1:start + 3] == [
        "    200 tokens written, 160 (80.0% waste) on candidates not kept: 150 dropped (120 truncated), 10 unused",
        "    its writing was stopped by the budget (budget_min): fewer prompts than num_prompts"]
    counts["magpie"]["magpie"] = {**report, "cut": 2}
    lines = format_summary(RunResult("out", counts, 0.0, 0, 1.0, False, True, 3)).splitlines()
    assert ("  magpie magpie: 12 candidates written, 3 kept (2 read cut at max_tokens, kept_truncated), 8 dropped "
            "(duplicate 1, truncated 7), 1 unused") in lines


def test_keep_truncated_keeps_a_cut_candidate_as_a_prompt(tmp_path, smollm2_tokenizer):
    """keep_truncated: the candidate cut at max_tokens (3: "A question cut off at", 4 tokens) is
    a prompt like any other; the common filters still drop the rest, and the report counts it as
    cut, its tokens as kept."""
    cfg = config(tmp_path / "out", 5, sources=[{"kind": "magpie", "num_prompts": 5, "max_tokens": 24,
                                                "keep_truncated": True}])
    store(cfg, smollm2_tokenizer, candidates())
    _, _, _, _, prompts, skips = setup(cfg, smollm2_tokenizer)
    assert [p.user_turns[0] for p in prompts] == ["Write a poem about the sea.", "A question cut off at",
                                                  "How do magnets work?", "Explain recursion.", "Name three rivers."]
    assert dict(skips.counts) == {"empty": 1, "duplicate": 1, "eval_overlap": 1, "too_long": 1}
    assert skips.reports["magpie"] == {
        "candidates": 9, "kept": 5, "unused": 0, "stopped_by_budget": False, "cut": 1,
        "dropped": {"duplicate": 1, "empty": 1, "eval_overlap": 1, "too_long": 1},
        "tokens": 45, "tokens_kept": 1 + 4 + 7 + 8 + 9, "tokens_dropped": 2 + 3 + 5 + 6, "tokens_truncated": 0,
        "tokens_unused": 0, "waste": round(16 / 45, 4)}


def test_keep_truncated_is_a_magpie_setting_and_settings_keep_their_old_form(tmp_path, smollm2_tokenizer):
    with pytest.raises(ValueError, match=r"\{'keep_truncated': True\} apply only to kind 'magpie', not 'sharegpt'"):
        config(tmp_path / "out", 3, sources=[{"kind": "sharegpt", "keep_truncated": True}])
    shaper = ChatShaper(smollm2_tokenizer, stop_token_ids(smollm2_tokenizer))
    for keep in (False, True):
        cfg = config(tmp_path / "out", 3, sources=[{"kind": "magpie", "num_prompts": 3, "keep_truncated": keep}])
        writer = MagpieWriter(cfg.sources[0], shaper, Path(cfg.out_dir), 0, target_identity(SMOLLM2), None)
        # the default is not stored: prompts written before the setting existed are read back
        assert ("keep_truncated" in writer.settings["source"]) is keep


def test_a_chunk_is_sized_by_the_share_of_candidates_usable_so_far(tmp_path, smollm2_tokenizer):
    """Nothing read: as many as the prompts missing. Then the missing prompts over the usable
    share of the candidates read, a tenth more, rounded up: 4 usable of 10 read, 100 missing ->
    275; with keep_truncated every candidate is usable -> 110."""
    shaper = ChatShaper(smollm2_tokenizer, stop_token_ids(smollm2_tokenizer))
    read = [{"finish_reason": "stop" if i < 4 else "length"} for i in range(10)]
    for keep, want in ((False, 275), (True, 110)):
        cfg = config(tmp_path / "out", 3, sources=[{"kind": "magpie", "num_prompts": 3, "keep_truncated": keep}])
        writer = MagpieWriter(cfg.sources[0], shaper, Path(cfg.out_dir), 0, target_identity(SMOLLM2), None)
        assert writer._needed(100) == 100
        writer.read = read
        assert writer._needed(100) == want


def test_a_chunk_writes_what_the_missing_prompts_need_and_no_more(tmp_path, smollm2_tokenizer):
    """The chunk's size: the first is as many as the prompts missing, at most MAX_CHUNK; later
    ones what `_needed` says, however few. The arm of 2026-11-27 (keep_truncated, 5,000 prompts,
    512 slots) wrote 4,096 + 4,096 candidates and used 5,000 of them: the second chunk is now
    995. Issue 39's profile job (2,000 prompts, one duplicate dropped) wrote 2,000 + 512, a batch
    at least, and 511 unused were 20% of the tokens: the second chunk is now 2."""
    from data_gen.magpie import MAX_CHUNK

    shaper = ChatShaper(smollm2_tokenizer, stop_token_ids(smollm2_tokenizer))
    cfg = config(tmp_path / "out", 3, sources=[{"kind": "magpie", "num_prompts": 5000, "keep_truncated": True}])
    writer = MagpieWriter(cfg.sources[0], shaper, Path(cfg.out_dir), 0, target_identity(SMOLLM2), None)
    assert writer._size(0, 5000) == MAX_CHUNK == 4096
    writer.read = [{"finish_reason": "length"}] * 4096  # cut, and kept: every candidate usable
    assert writer._size(4096, 904) == 995  # 904 * 1.1, rounded up
    assert writer._size(4096, 10) == 11
    assert writer._size(4096, 1) == 2
    assert writer._size(19_900, 904) == 100  # the source's max_candidates (20,000) caps it


@pytest.mark.parametrize("max_tokens, answer_tokens", [(24, 1024), (300, 200)])
def test_the_magpie_writer_and_the_answers_get_engine_rows_of_one_length(tmp_path, monkeypatch, max_tokens,
                                                                         answer_tokens):
    """Every generator of a run is built for cache rows of max_prompt_len plus the most new tokens
    any of them writes (the answers' or a magpie source's), so that the engine's compiled decode
    forward, which depends on that shape alone, is compiled once for both."""
    from data_gen import pipeline
    from data_gen.config import SamplingConfig

    built = []  # (new tokens, the max_prompt_len the engine is built with) of each generator
    monkeypatch.setattr(pipeline, "build_generator", lambda *a: built.append((a[1].max_new_tokens, a[-1])))
    cfg = config(tmp_path, 4, sources=[{"kind": "magpie", "num_prompts": 4, "max_tokens": max_tokens},
                                       {"kind": "sharegpt", "num_prompts": 4}],
                 sampling={"max_new_tokens": answer_tokens})
    shaper = type("Shaper", (), {"stop_ids": [2]})()
    generators = pipeline.Generators(cfg, type("Tok", (), {"pad_token_id": 0})())
    generators.build(SamplingConfig(max_new_tokens=max_tokens, temperature=1.0), shaper)
    generators.build(cfg.sampling, shaper)
    most = max(max_tokens, answer_tokens)
    assert built == [(max_tokens, 64 + most - max_tokens), (answer_tokens, 64 + most - answer_tokens)]


def test_generators_count_the_seconds_loading_the_target(tmp_path, monkeypatch):
    """Generators.load_s: the seconds of the build that loaded the target (the summary's "target
    loaded in"), not those of a later build on the loaded one, nor any where it came loaded."""
    import time

    from data_gen import pipeline
    from data_gen.config import SamplingConfig

    def build_generator(*args):
        time.sleep(0.2 if args[-2] is None else 0.0)  # args[-2]: the target already loaded, if any
        return type("Generator", (), {"target": "the loaded target"})()

    monkeypatch.setattr(pipeline, "build_generator", build_generator)
    cfg = config(tmp_path, 4)
    shaper = type("Shaper", (), {"stop_ids": [2]})()
    generators = pipeline.Generators(cfg, type("Tok", (), {"pad_token_id": 0})())
    generators.build(SamplingConfig(max_new_tokens=8, temperature=1.0), shaper)
    assert 0.2 <= generators.load_s < 1.0 and generators.target == "the loaded target"
    first = generators.load_s
    generators.build(cfg.sampling, shaper)
    assert generators.load_s == first
    loaded = pipeline.Generators(cfg, type("Tok", (), {"pad_token_id": 0})(), target="given")
    loaded.build(cfg.sampling, shaper)
    assert loaded.load_s == 0
