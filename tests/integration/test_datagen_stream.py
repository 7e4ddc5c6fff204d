"""The engine streamed through the turn scheduler, on the real SmolLM2 target (float32, CPU):
a conversation's next turn is queued the moment its answer ends and the engine never drains
before the work does; the rows equal those of the same engine called turn by turn and of
`hf`, greedy and sampled for any slot count; a budget and a kill -9 then a rerun end and
finish the stream as they do the calls."""

import json
import re
import types
from collections import Counter

import pytest
import torch

import data_gen.generators
from data_gen.build import build_generator
from data_gen.config import to_datagen_config
from data_gen.pipeline import run, setup
from data_gen.turns import generate_shards
from dflash_train.data.format import load_generated, read_manifest
from tests.cli_helpers import run_cli
from tests.conftest import SMOLLM2
from tests.datagen_helpers import (Clock, an_hour_after_each_admission, compose_config,
                                   kill_after_first_shard, overrides, write_conversations)

# one thread: tiny matmuls do not split, and on a shared CPU the second thread waits
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
MAX_NEW = 10
IM_END, IM_START = 2, 1
CONVERSATIONS = 8  # of 1, 2 and 3 user turns in turn (tests/datagen_helpers.py)


def config(tmp_path, name: str, kind: str, batch_size: int, **overrides):
    src = tmp_path / "conversations.jsonl"
    if not src.exists():
        write_conversations(src, CONVERSATIONS)
    return to_datagen_config({
        "target": {"name": SMOLLM2}, "out_dir": str(tmp_path / name), "exclude_eval": [],
        "sources": [{"kind": "jsonl", "path": str(src)}], "shard_size": 2, "template": {"max_turns": None},
        "sampling": {"max_new_tokens": MAX_NEW}, "backend": {"kind": kind, "batch_size": batch_size}, **overrides})


def shards_of(cfg, tokenizer) -> tuple:
    """(chat shaper, the prompts in shards as the pipeline cuts them)."""
    _, _, _, shaper, prompts, _ = setup(cfg, tokenizer)
    return shaper, {k: prompts[i:i + cfg.shard_size] for k, i in enumerate(range(0, len(prompts), cfg.shard_size))}


def generator(cfg, shaper, target, tokenizer):
    return build_generator(cfg.backend, cfg.sampling, SMOLLM2, shaper.stop_ids, IM_END, tokenizer, target=target,
                           max_prompt_len=cfg.max_prompt_len)


def rows_of(done) -> list[dict]:
    return [r for _, rows, _ in sorted(done, key=lambda d: d[0]) for r in rows]


class Calls:
    """The engine behind the call interface only: the scheduler calls it turn by turn."""

    def __init__(self, gen):
        self.gen = gen

    def generate(self, prompts, seeds, deadline=None):
        return self.gen.generate(prompts, seeds, deadline)


class Watched:
    """The engine's streamed interface, logging what the scheduler does: each turn submitted,
    each answer handed over, and the engine's state as the scheduler hands back control."""

    def __init__(self, gen, on_submit=None):
        self.gen, self.on_submit = gen, on_submit
        self.streams, self.drains, self.events = True, 0, []
        self.work_left: list[int] = []  # per answer: prompts queued or in slots once the caller is done
        self.queued_beyond_free: list[int] = []  # per answer: queued prompts the next admission cannot take

    def wanted(self) -> int:
        return self.gen.wanted()

    def submit(self, key, prompt, seed) -> None:
        engine = self.gen.engine
        self.events.append(("submit", key, sum(k is not None for k in engine.slot_key)))
        self.gen.submit(key, prompt, seed)
        if self.on_submit is not None:
            self.on_submit(key)

    def drain(self, deadline=None):
        self.drains += 1
        engine = self.gen.engine
        for key, answer in self.gen.drain(deadline):
            self.events.append(("answer", key, answer))
            self.queued_beyond_free.append(max(0, len(engine.queue) - engine.slot_key.count(None)))
            yield key, answer
            self.work_left.append(len(engine.queue) + sum(k is not None for k in engine.slot_key))

    def unstarted(self) -> list:
        return self.gen.unstarted()


def test_streamed_rows_equal_the_calls_and_hf(tmp_path, smollm2, smollm2_tokenizer):
    """Greedy, float32: the pipeline's streamed engine run (3 slots, shards of 2) writes the
    rows of the same engine called with 3 turns at a time, and those of hf."""
    data = {}
    for kind in ("engine", "hf"):
        cfg = config(tmp_path, kind, kind, batch_size=3)
        assert run(cfg, target=smollm2, tokenizer=smollm2_tokenizer, progress=False).complete
        data[kind] = load_generated(cfg.out_dir).to_list()
    cfg = config(tmp_path, "calls", "engine", batch_size=3)
    shaper, shards = shards_of(cfg, smollm2_tokenizer)
    calls = rows_of(generate_shards(cfg, shaper, Calls(generator(cfg, shaper, smollm2, smollm2_tokenizer)), shards,
                                    call_size=3))
    assert data["engine"] == calls == data["hf"]
    answered = [(row["input_ids"].count(IM_START) - 1) // 2 for row in data["engine"]]
    assert len(answered) == CONVERSATIONS and max(answered) == 3, answered
    counts = read_manifest(tmp_path / "engine")["counts"]
    assert counts == read_manifest(tmp_path / "hf")["counts"] and counts["rows"] == CONVERSATIONS


def test_sampled_streamed_rows_are_the_same_for_any_slot_count(tmp_path, smollm2, smollm2_tokenizer):
    """Each turn samples from its own seed, whatever slot or moment it runs in: 2 and 5 slots
    and hf in calls write the same rows, which differ from the greedy ones."""
    sampling = {"max_new_tokens": MAX_NEW, "temperature": 0.9, "top_p": 0.9, "top_k": 40}
    rows = {}
    for kind, slots in (("engine", 2), ("engine", 5), ("hf", 3), ("greedy", 5)):
        cfg = config(tmp_path, f"{kind}{slots}", "engine" if kind == "greedy" else kind, slots,
                     **({} if kind == "greedy" else {"sampling": sampling}))
        shaper, shards = shards_of(cfg, smollm2_tokenizer)
        gen = generator(cfg, shaper, smollm2, smollm2_tokenizer)
        rows[kind, slots] = rows_of(generate_shards(cfg, shaper, gen, shards, call_size=3))
    assert rows["engine", 2] == rows["engine", 5] == rows["hf", 3]
    assert [r["input_ids"] for r in rows["engine", 2]] != [r["input_ids"] for r in rows["greedy", 5]]


def test_next_turn_is_queued_as_its_answer_ends(tmp_path, smollm2, smollm2_tokenizer):
    """One drain for the whole job: every later turn is submitted right after the answer before
    it is handed over, some while other answers are still in their slots; no handed-over
    answer leaves the engine without work until the last; and no turn waits in the queue for
    a slot (the next admission takes all that is queued)."""
    cfg = config(tmp_path, "watched", "engine", batch_size=3)
    shaper, shards = shards_of(cfg, smollm2_tokenizer)
    watched = Watched(generator(cfg, shaper, smollm2, smollm2_tokenizer))
    done = list(generate_shards(cfg, shaper, watched, shards, call_size=3))
    assert watched.drains == 1 and len(done) == len(shards)
    events = watched.events
    answers = [i for i, e in enumerate(events) if e[0] == "answer"]
    going_on = [i for i in answers if events[i][2].finish_reason == "stop"
                and any(e[:2] == ("submit", events[i][1]) for e in events[i + 1:])]
    assert len(going_on) >= 5, "later turns were asked"
    for i in going_on:
        assert events[i + 1][:2] == ("submit", events[i][1]), events[i:i + 2]
    assert any(events[i + 1][2] > 0 for i in going_on), "a next turn went in beside answers in flight"
    assert all(left > 0 for left in watched.work_left[:-1]) and watched.work_left[-1] == 0, watched.work_left
    assert watched.queued_beyond_free == [0] * len(answers)
    assert rows_of(done) == rows_of(generate_shards(cfg, shaper, Calls(watched.gen), shards, call_size=3))


def turns(events) -> tuple[list, dict]:
    """From a Watched log: the turns asked, (key, turn) in order, and the answer ids of each
    turn answered."""
    asked, answers, seen = [], {}, Counter()
    for kind, key, what in events:
        if kind == "submit":
            asked.append((key, sum(a[0] == key for a in asked)))
        else:
            answers[key, seen[key]] = what.ids
            seen[key] += 1
    return asked, answers


def test_a_turn_queued_at_the_deadline_is_cut(tmp_path, smollm2, smollm2_tokenizer, monkeypatch):
    """The deadline passes as the first later turn is queued: nothing is asked after it, it and
    whatever was queued with it never start, the answers in flight finish as without a
    deadline, and each shard begun is returned with every conversation at its last answer,
    those the deadline stopped counted (budget_cut; ended early or skipped by "budget")."""
    cfg = config(tmp_path, "cut", "engine", batch_size=2)
    shaper, shards = shards_of(cfg, smollm2_tokenizer)
    full = Watched(generator(cfg, shaper, smollm2, smollm2_tokenizer))
    list(generate_shards(cfg, shaper, full, shards, call_size=3))
    _, want = turns(full.events)

    clock = Clock()
    monkeypatch.setattr(data_gen.generators, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    asked_before = Counter()

    def late_at_a_later_turn(key):
        asked_before[key] += 1
        if asked_before[key] == 2:
            clock.now += 3600

    cut = Watched(generator(cfg, shaper, smollm2, smollm2_tokenizer), late_at_a_later_turn)
    done = list(generate_shards(cfg, shaper, cut, shards, call_size=3, deadline=clock.now + 60))
    asked, got = turns(cut.events)
    late = asked[-1]
    assert [a for a in asked if a[1] > 0] == [late], "nothing was asked after the deadline"
    assert got == {a: want[a] for a in got}, "the answers in flight finished as without a deadline"
    unstarted = [a for a in asked if a not in got]
    assert late in unstarted and unstarted == asked[len(asked) - len(unstarted):]
    assert not cut.gen.engine.queue
    answered, answers_without = Counter(key for key, _ in got), Counter(key for key, _ in want)
    assert sorted(k for k, _, _ in done) == sorted({k for k, _ in answered})
    for k, rows, meta in done:
        convs = [(k, pos) for pos in range(len(shards[k]))]
        assert [r["input_ids"][-r["response_len"]:] for r in rows] == [got[c, answered[c] - 1] for c in convs
                                                                      if answered[c]]
        stopped = [c for c in convs if answered[c] < answers_without[c]]
        assert meta.get("budget_cut", 0) == len(stopped) and (late[0] in stopped or late[0] not in convs), meta
        assert meta["ended_early"].get("budget", 0) == sum(answered[c] > 0 for c in stopped), meta
        assert meta["skipped"].get("budget", 0) == sum(answered[c] == 0 for c in stopped), meta


def test_a_budget_ends_the_stream_and_a_rerun_adds_nothing(tmp_path, smollm2, smollm2_tokenizer, monkeypatch):
    """budget_min runs out once the engine's 2 slots took their first turns: the two
    conversations of three turns (2 and 5, of shards 1 and 2: the longest start first). Both
    answers finish, no second turn is asked; shards 1 and 2 are written with those rows (their
    other conversations skipped), the shards not begun are not, and the same command again
    generates nothing."""
    full = config(tmp_path, "full", "engine", batch_size=2)
    run(full, target=smollm2, tokenizer=smollm2_tokenizer, progress=False)
    an_hour_after_each_admission(monkeypatch)
    cfg = config(tmp_path, "budget", "engine", batch_size=2, budget_min=1.0)
    result = run(cfg, target=smollm2, tokenizer=smollm2_tokenizer, progress=False)
    manifest = read_manifest(cfg.out_dir)
    shards = -(-CONVERSATIONS // 2)
    assert manifest["budget"] == {"minutes": 1.0, "reached": True, "shards": 2, "of": shards,
                                  "prompts_unstarted": CONVERSATIONS - 2}
    assert result.budget_reached and result.unstarted == CONVERSATIONS - 2 and not result.complete
    data, reference = load_generated(cfg.out_dir), load_generated(full.out_dir)
    _, _, _, shaper, prompts, _ = setup(cfg, smollm2_tokenizer)
    longest = [i for i, p in enumerate(prompts) if len(p.user_turns) == 3]
    assert longest == [2, 5] and data["prompt_id"] == [prompts[i].prompt_id for i in longest]
    for row, i in zip(data, longest):
        ids, _ = shaper.prompt(prompts[i].system, prompts[i].user_turns, [])
        first = row["input_ids"][len(ids):]
        assert row["input_ids"][:len(ids)] == ids and first[-1] == IM_END and first.count(IM_END) == 1
        assert reference[i]["input_ids"][:len(row["input_ids"])] == row["input_ids"], "the first answer as without it"
        assert reference[i]["input_ids"][len(ids):].count(IM_END) >= 2, "without the budget it went on"
    counts = manifest["counts"]
    assert counts["ended_early"] == {"budget": 2} and counts["finish_reasons"] == {"stop": 2}
    assert json.loads((tmp_path / "budget" / "budget.json").read_text())["seconds"] == pytest.approx(3600.0)
    before = {p: p.read_bytes() for p in (tmp_path / "budget").rglob("*") if p.is_file()}
    again = run(cfg, target=smollm2, tokenizer=smollm2_tokenizer, progress=False)
    assert again.budget_reached and again.generated_tokens == 0
    assert {p: p.read_bytes() for p in (tmp_path / "budget").rglob("*") if p.is_file()} == before


def test_kill_9_then_rerun_finishes_every_conversation_once(tmp_path, smollm2, smollm2_tokenizer):
    """Every turn streamed through 2 slots over shards of 2: the kill lands with some shards
    committed and the others not; the rerun finishes those, and the whole equals hf's run."""
    num = 10  # 5 shards of 2: the kill lands with 3 committed (measured), 2 left for the rerun
    src = tmp_path / "conversations.jsonl"
    write_conversations(src, num)
    args = overrides(tmp_path / "killed", src, shard_size=2, batch_size=2, max_new_tokens=MAX_NEW)
    args += ["backend.kind=engine", "template.max_turns=null"]
    committed = kill_after_first_shard(args, tmp_path / "killed")
    assert 1 <= len(committed) < num // 2 and not (tmp_path / "killed" / "manifest.json").exists()
    rerun = run_cli("dflash-datagen", *args)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert re.search(rf"rows written +{num}\n", rerun.stdout), rerun.stdout

    reference = compose_config([f"out_dir={tmp_path / 'hf'}", *args[1:-2], "backend.kind=hf",
                                "template.max_turns=null"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the command's backend.cpu_threads=1
    try:
        run(reference, target=smollm2, tokenizer=smollm2_tokenizer, progress=False)
    finally:
        torch.set_num_threads(threads)
    got, want = load_generated(tmp_path / "killed"), load_generated(tmp_path / "hf")
    assert sorted(got["prompt_id"]) == sorted(set(got["prompt_id"])) and len(got) == num
    assert got[:] == want[:]
    assert max((row.count(IM_START) - 1) // 2 for row in got["input_ids"]) == 3, "third turns were answered"
