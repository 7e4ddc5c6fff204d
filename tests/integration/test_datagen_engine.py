"""backend.kind=engine on the real SmolLM2 target (float32, CPU): the same answers as `hf`,
greedy and sampled, with either decode attention (sdpa, flex), from the generator and from a
multi-turn pipeline run; a kill -9 in the middle of an engine run and a rerun hold every
prompt exactly once."""

import json
import re

import pytest

from data_gen.config import BackendConfig, SamplingConfig, to_datagen_config
from data_gen.engine import EngineGenerator
from data_gen.hf_generator import HFGenerator
from data_gen.pipeline import run
from data_gen.template import ChatShaper
from dflash_train.data.format import load_generated, read_shard_meta
from tests.cli_helpers import run_cli
from tests.conftest import SMOLLM2
from tests.datagen_helpers import (Clock, compose_config, kill_after_first_shard, overrides,
                                   write_conversations, write_prompts)

# one thread: tiny matmuls do not split, and on a shared CPU the second thread waits
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
MAX_NEW = 10
IM_END = 2
WORDS = "red green blue cat dog sun moon tree river stone bird fish rain snow wind fire".split()


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    """32 chat prompts of 32 different lengths: half ask for one number (short answers that
    stop), half for a story (answers cut at MAX_NEW)."""
    shaper = ChatShaper(smollm2_tokenizer, [IM_END])
    texts = [" ".join((WORDS * 6)[:3 * i]) + (f" What is {i}+1? Answer with one number." if i % 2 else
                                          f" Write a long story about the number {i}.") for i in range(32)]
    return [shaper.prompt(None, [t], [])[0] for t in texts]


@pytest.fixture(scope="module")
def once():
    """Answers that several tests compare against, generated once per module: the same call
    with the same arguments always gives the same answers (greedy, or each prompt's own seed)."""
    answers = {}

    def get(key, make):
        if key not in answers:
            answers[key] = make()
        return answers[key]

    return get


def generate(kind, target, prompts, batch_size, seeds=None, attention="sdpa", sync_steps=None, **sampling):
    cfg = BackendConfig(kind=kind, batch_size=batch_size, attention=attention, sync_steps=sync_steps)
    s = SamplingConfig(max_new_tokens=MAX_NEW, **sampling)
    gen = (EngineGenerator(target, cfg, s, [IM_END], max_prompt_len=256) if kind == "engine"
           else HFGenerator(target, cfg, s, [IM_END], IM_END))
    return gen.generate(prompts, seeds or list(range(len(prompts))))


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_greedy_answers_equal_hf(smollm2, prompts, attention, once):
    """8 slots for 32 prompts: rows refill as answers end, beside rows of other lengths."""
    assert len({len(p) for p in prompts}) == 32
    model_attention = smollm2.model.config._attn_implementation
    engine = once(f"engine greedy {attention}", lambda: generate("engine", smollm2, prompts, 8, attention=attention))
    hf = once("hf greedy", lambda: generate("hf", smollm2, prompts, batch_size=8))
    assert [c.ids for c in engine] == [c.ids for c in hf]
    assert [c.finish_reason for c in engine] == [c.finish_reason for c in hf]
    reasons = [c.finish_reason for c in engine]
    assert 4 <= reasons.count("stop") <= 28, reasons
    assert all(len(c.ids) == MAX_NEW for c in engine if c.finish_reason == "length")
    assert all(c.ids[-1] == IM_END and IM_END not in c.ids[:-1] for c in engine if c.finish_reason == "stop")
    assert smollm2.model.config._attn_implementation == model_attention, "the caller's model keeps its attention"


def test_bucketed_prefills_give_the_same_answers(smollm2, prompts, once):
    """The prefill shapes of CUDA graphs (rows and widths rounded up to powers of two, groups
    padded with copies of a row; data_gen/engine_prefill.py Shapes), run eagerly: the greedy answers
    are hf's."""
    gen = EngineGenerator(smollm2, BackendConfig(kind="engine", batch_size=8, attention="sdpa"),
                          SamplingConfig(max_new_tokens=MAX_NEW), [IM_END], max_prompt_len=256, buckets=True)
    assert gen.engine.shapes.buckets
    answers = gen.generate(prompts, list(range(len(prompts))))
    hf = once("hf greedy", lambda: generate("hf", smollm2, prompts, batch_size=8))
    assert [(c.ids, c.finish_reason) for c in answers] == [(c.ids, c.finish_reason) for c in hf]


@pytest.mark.parametrize("buckets", [False, True])
def test_packed_prefills_give_the_same_answers(smollm2, prompts, once, buckets):
    """backend.prefill=packed: the fresh prompts of an admission in one row, each attending to
    itself alone (flex under a block mask; data_gen/engine_attention.py packed_block_mask), the
    row exactly as long as its prompts or (buckets) rounded up with padding of its own; the
    greedy answers are hf's."""
    gen = EngineGenerator(smollm2, BackendConfig(kind="engine", batch_size=8, attention="sdpa", prefill="packed"),
                          SamplingConfig(max_new_tokens=MAX_NEW), [IM_END], max_prompt_len=256, buckets=buckets)
    assert gen.engine.prefill == "packed" and gen.engine.shapes.buckets == buckets
    answers = gen.generate(prompts, list(range(len(prompts))))
    hf = once("hf greedy", lambda: generate("hf", smollm2, prompts, batch_size=8))
    assert [(c.ids, c.finish_reason) for c in answers] == [(c.ids, c.finish_reason) for c in hf]


def test_short_prompts_split_into_the_forwards_their_grid_allows_give_the_same_answers(smollm2, prompts, monkeypatch):
    """24 prompts of 4 tokens admitted at once: one packed forward's tokens, but one of 128
    tokens holds 16 prompts at most (Shapes.prompts: flash attention's sequences a captured
    forward fixes), so they go in two; the greedy answers are hf's."""
    from data_gen import engine

    sizes = []

    def recorded(todo, shapes):
        for length, group in engine_groups(todo, shapes):
            sizes.append((length, len(group)))
            yield length, group

    engine_groups = engine.packed_groups
    monkeypatch.setattr(engine, "packed_groups", recorded)
    short = [p[-4:] for p in prompts[:24]]
    gen = EngineGenerator(smollm2, BackendConfig(kind="engine", batch_size=24, attention="sdpa", prefill="packed"),
                          SamplingConfig(max_new_tokens=MAX_NEW), [IM_END], max_prompt_len=256, buckets=True)
    answers = gen.generate(short, list(range(24)))
    assert sizes[:2] == [(128, 16), (128, 8)], sizes
    hf = generate("hf", smollm2, short, 8)
    assert [(c.ids, c.finish_reason) for c in answers] == [(c.ids, c.finish_reason) for c in hf]


def test_longer_chunks_give_the_same_answers(smollm2, prompts, once):
    """backend.sync_steps=3: the host reads the slots every 3 decode steps (a finished slot idles
    up to 2 steps before its next prompt), and the greedy answers are those of reading after
    every step (the default on CPU)."""
    chunked = EngineGenerator(smollm2, BackendConfig(kind="engine", batch_size=8, attention="sdpa", sync_steps=3),
                              SamplingConfig(max_new_tokens=MAX_NEW), [IM_END], max_prompt_len=256)
    assert chunked.engine.sync_steps == 3
    answers = chunked.generate(prompts, list(range(len(prompts))))
    every_step = once("engine greedy sdpa", lambda: generate("engine", smollm2, prompts, 8))
    assert [(c.ids, c.finish_reason) for c in answers] == [(c.ids, c.finish_reason) for c in every_step]


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_sampled_answers_equal_hf_whatever_the_batch(smollm2, prompts, attention, once):
    """Both generators draw each token from the prompt's own seed (data_gen/sampling.py)."""
    few, seeds = prompts[::4], [7 * i + 1 for i in range(8)]
    sampling = dict(temperature=0.9, top_p=0.9, top_k=40)
    engine3 = generate("engine", smollm2, few, 3, seeds, attention, **sampling)
    engine8 = generate("engine", smollm2, few, 8, seeds, attention, **sampling)
    hf = once("hf sampled", lambda: generate("hf", smollm2, few, 4, seeds, **sampling))
    assert [c.ids for c in engine3] == [c.ids for c in engine8] == [c.ids for c in hf]
    greedy = once("engine greedy few", lambda: generate("engine", smollm2, few, 8))
    assert [c.ids for c in engine3] != [c.ids for c in greedy]


def test_prompt_longer_than_the_cache_is_refused(smollm2):
    gen = EngineGenerator(smollm2, BackendConfig(kind="engine", batch_size=2), SamplingConfig(max_new_tokens=4),
                          [IM_END], max_prompt_len=8)
    with pytest.raises(ValueError, match=r"prompt 0 of 9 tokens: the engine holds 1 to 8 prompt tokens"):
        gen.generate([[5] * 9], [0])


@pytest.mark.parametrize("prefill", ["padded", "packed"])
def test_multi_turn_run_equals_hf(tmp_path, smollm2, smollm2_tokenizer, prefill):
    """Through the pipeline: every turn answered on the engine's own earlier answers (the later
    turns prefilled after what their rows kept, the fresh prompts padded or packed)."""
    conversations = [["What is 2+2? Answer with one number.", "Add 3 to it. Answer with one number."],
                     ["Name a color. One word only."],
                     ["Is the sky blue? Answer yes or no.", "Is grass green? Answer yes or no.", "Why?"]]
    src = tmp_path / "conversations.jsonl"
    src.write_text("\n".join(json.dumps({"messages": [m for u in users for m in (
        {"role": "user", "content": u}, {"role": "assistant", "content": "old"})]}) for users in conversations))
    data = {}
    for kind in ("engine", "hf"):
        cfg = to_datagen_config({"target": {"name": SMOLLM2}, "out_dir": str(tmp_path / kind), "exclude_eval": [],
                                 "sources": [{"kind": "jsonl", "path": str(src)}], "shard_size": 2,
                                 "template": {"max_turns": None}, "sampling": {"max_new_tokens": MAX_NEW},
                                 "backend": {"kind": kind, "batch_size": 2,
                                             **({"prefill": prefill} if kind == "engine" else {})}})
        assert run(cfg, target=smollm2, tokenizer=smollm2_tokenizer, progress=False).complete
        data[kind] = load_generated(cfg.out_dir)
    assert data["engine"][:] == data["hf"][:]
    assert max(data["engine"]["input_ids"][i].count(1) for i in range(3)) >= 5, "a later turn was answered"


@pytest.mark.parametrize("conversations, sync_steps, buckets, prefill", [
    (3, 1, False, "padded"), (4, 1, False, "padded"), (3, 3, False, "padded"), (3, 1, True, "padded"),
    (3, 1, True, "packed")])
def test_next_turn_prefills_after_what_its_slot_holds(smollm2, prompts, monkeypatch, conversations, sync_steps,
                                                       buckets, prefill):
    """Conversations of three turns through 3 slots, each next turn the earlier prompt, its
    answer and new user tokens, queued as its answer comes out: it takes its last answer's
    slot and prefills only what the row does not hold, the new tokens and the answer's last
    two (its last token was never fed; the one before is where an ended row goes on writing).
    With a fourth conversation queued first, it takes the first slot that frees and that
    conversation's next turn prefills whole elsewhere. Every answer equals a fresh engine's for
    the same prompt, which prefills it whole; so too with the slots read every 3 steps (an ended
    row goes on writing at the same position until the host sees it), and with the prefills at
    the bucketed shapes of CUDA graphs (run eagerly here); and with the next turns packed in one
    row (backend.prefill=packed), each attending to its own cache row."""
    from data_gen.engine import GenerationEngine

    after = []
    method = "_prefill_after_packed" if prefill == "packed" else "_prefill_after"
    prefill_after = getattr(GenerationEngine, method)
    monkeypatch.setattr(GenerationEngine, method,
                        lambda self, todo: (after.extend(len(t) - start for _, t, start in todo),
                                            prefill_after(self, todo))[1])
    sampling = SamplingConfig(max_new_tokens=MAX_NEW)
    engine = GenerationEngine(smollm2, 3, 256, sampling, [IM_END], cuda_graphs=False, sync_steps=sync_steps,
                              buckets=buckets, prefill=prefill)
    user = {k: [[IM_END - 1] + prompts[2 * k + 1][-4 - t:] for t in range(2)] for k in range(conversations)}
    asked, answers = {k: [prompts[2 * k + 1]] for k in range(conversations)}, {}
    for k in range(conversations):
        engine.submit(k, asked[k][0])
    for key, answer in engine.drain():
        answers.setdefault(key, []).append(answer.ids)
        turn = len(answers[key])
        if turn < 3:
            asked[key].append(asked[key][-1] + answer.ids + user[key][turn - 1])
            engine.submit(key, asked[key][-1])
    expected = sorted(len(u) + 1 for k in range(conversations) for u in user[k])
    if conversations == 3:
        assert sorted(after) == expected, "every later turn prefilled only what its row did not hold"
    else:
        assert 0 < len(after) < len(expected) and all(n in expected for n in after), after
    fresh = GenerationEngine(smollm2, 1, 256, sampling, [IM_END], cuda_graphs=False, prefill="padded")
    for k in range(conversations):
        for turn, prompt in enumerate(asked[k]):
            fresh.submit((k, turn), prompt)
    assert {key: a.ids for key, a in fresh.drain()} == {(k, t): answers[k][t] for k in range(conversations)
                                                        for t in range(3)}


def test_kill_9_then_rerun_holds_every_prompt_once(tmp_path, smollm2, smollm2_tokenizer):
    """Prompts streamed through 2 slots, each shard committed as its prompts end: the kill
    lands with some shards committed and the others not; the rerun finishes those only."""
    num_prompts = 16  # 4 shards of 4: the kill lands after the first (one committed, measured)
    src = tmp_path / "prompts.jsonl"
    write_prompts(src, num_prompts)
    args = overrides(tmp_path / "killed", src, shard_size=4, batch_size=2) + ["backend.kind=engine"]
    committed = kill_after_first_shard(args, tmp_path / "killed")
    assert 1 <= len(committed) < num_prompts // 4 and not (tmp_path / "killed" / "manifest.json").exists()

    rerun = run_cli("dflash-datagen", *args)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert re.search(rf"rows written +{num_prompts}\n", rerun.stdout), rerun.stdout
    # The rerun generated only the prompts of the uncommitted shards.
    generated = int(re.search(r"generated this run +(\d+)", rerun.stdout).group(1))
    got = load_generated(tmp_path / "killed")
    done_before = {p for f in committed for p in read_shard_meta(tmp_path / "killed", int(f.stem[6:]))["prompt_ids"]}
    rest = [r for r in got if r["prompt_id"] not in done_before]
    assert generated == sum(r["response_len"] for r in rest) and rest

    reference = compose_config(overrides(tmp_path / "hf", src, shard_size=4, batch_size=2) + ["backend.kind=hf"])
    run(reference, target=smollm2, tokenizer=smollm2_tokenizer, progress=False)
    want = load_generated(tmp_path / "hf")
    assert sorted(got["prompt_id"]) == sorted(set(got["prompt_id"])) and len(got) == num_prompts
    assert got[:] == want[:]


def test_benchmark_table_on_cpu(tmp_path, capsys):
    """benchmarks/datagen_engine.py end to end on CPU: one row per kind, the same answers."""
    src = tmp_path / "prompts.jsonl"
    write_prompts(src, 4)
    _benchmark()["main"](["--target", SMOLLM2, "--jsonl", str(src), "--prompts", "4", "--batch-size", "2",
                   "--max-new-tokens", "4", "--threads", "1", "--kinds", "hf,engine,engine-eager"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("4 prompts (") and "batch 2, max_new_tokens 4" in lines[0]
    rows = [line.split() for line in lines[2:]]
    assert [r[0] for r in rows] == ["hf", "engine", "engine-eager"]
    assert len({r[1] for r in rows}) == 1 and 4 <= int(rows[0][1]) <= 16, "the same tokens, at most 4 each"
    assert all(float(r[4]) > 0 and r[6] == "n/a" and r[7] == "4/4" for r in rows), rows


def test_kernel_table_sums_each_kernel_name():
    """The profiled pass's kernel table: device seconds summed by name (cut at 70 characters:
    two templated names that differ past there are one row), its share of the wall, launches,
    microseconds a launch, the longest first, and what the top rows leave out in the last row."""
    long = "void flash_fwd_kernel<" + "x" * 60
    events = [("gemm", 0, 3_000_000), ("gemm", 5, 1_000_000), (long + "A", 9, 500_000), (long + "B", 9, 500_000),
              ("copy", 1, 250_000), ("norm", 2, 125_000)]
    lines = _benchmark()["kernel_table"](events, wall=0.01, top=2)
    assert lines[0] == "  kernels of the profiled pass, by device time (wall 0.01 s)"
    rows = [line.split() for line in lines[2:]]
    assert rows[0] == ["gemm", "0.004", "40.0%", "2", "2000.0"]
    assert lines[3][2:74].rstrip() == long[:70] and lines[3][74:].split() == ["0.001", "10.0%", "2", "500.0"]
    assert lines[-1].split() == ["the", "other", "2", "kernels", "0.000", "3.8%"], "copy and norm: 0.375 ms"
    assert len(lines) == 5


def _benchmark():
    import runpy
    from pathlib import Path

    return runpy.run_path(str(Path(__file__).parents[2] / "benchmarks" / "datagen_engine.py"), run_name="bench")


def test_profile_of_an_every_turn_job_with_magpie_on_cpu(tmp_path, capsys):
    """--profile on the issue's kind of job (every turn of multi-turn conversations, plus prompts
    the target writes), both decode attentions: every turn asked is answered, every prompt is
    a row, the same rows with either attention, each table's parts are measured (none negative,
    decode and prefill under way) and sum to the wall the host measured, the turn scheduler's
    time inside the streamed drain is reported for every answer, and the attention replay
    reports its bandwidth.

    The scheduler's time is host time between two spans, so on CPU it lies within the device's
    idle time (host scheduling plus the gaps between drains): the answers of a drain's last
    round are handled after its last span, in the gap the table counts between drains, so it
    need not fit in the in-drain part alone (a loaded host measured 0.018 s against 0.012)."""
    src = tmp_path / "conversations.jsonl"
    write_conversations(src, 4)  # 1, 2, 3 and 1 user turns
    _benchmark()["main"](["--target", SMOLLM2, "--jsonl", str(src), "--prompts", "4", "--all-turns", "--magpie", "2",
                          "--magpie-tokens", "24", "--batch-size", "3", "--max-new-tokens", "8", "--threads", "1",
                          "--kinds", "engine,engine-flex", "--profile"])
    out = capsys.readouterr().out
    kept = int(re.search(r"^magpie: (\d+) prompts kept of \d+ candidates", out, re.M).group(1))
    assert 1 <= kept <= 2
    assert out.startswith(f"{4 + kept} prompts (") and f"; {7 + kept} user turns, every turn)" in out.splitlines()[0]
    rows = {m.group(1): m.group(2).split() for m in re.finditer(r"^(engine(?:-flex)?) +(.*)$", out, re.M)}
    assert sorted(rows) == ["engine", "engine-flex"]
    assert rows["engine"][0] == rows["engine-flex"][0], "the same tokens with either attention"
    for kind, row in rows.items():
        tokens, wall, asked, answered, written = int(row[0]), float(row[2]), int(row[7]), int(row[8]), int(row[9])
        assert 4 + kept <= asked == answered <= 7 + kept and written == 4 + kept, (kind, row)
        assert row[6] == f"{written}/{written}", "flex writes the rows sdpa writes"
        attention = "flex" if kind == "engine-flex" else "sdpa"
        profile = out.split(f"profile ({attention} attention), CPU: wall timers")[1].split("profile (")[0]
        parts = {name.strip(): float(sec) for name, sec in
                 re.findall(r"^  ([a-z][a-z ,()']+?) +(-?\d+\.\d+) +\d+\.\d%", profile, re.M)}
        assert len(parts) == 6 and min(parts.values()) >= 0, parts
        assert parts["decode steps"] > 0 and parts["prefill (fresh rows)"] > 0, parts
        # The later turns prefill after what their rows kept: fewer tokens than their prompts.
        fed = {part: int(n) for part, n in re.findall(r"^  (prefill.*?) +\d+\.\d+ +\d+\.\d%  \d+ spans, (\d+) tokens",
                                                      profile, re.M)}
        assert sorted(fed) == ["prefill (fresh rows)", "prefill after a kept prefix"], profile
        assert fed["prefill after a kept prefix"] > 0 and parts["prefill after a kept prefix"] > 0, fed
        # What the forwards fed, padding included: at least the prompt tokens (CPU: no buckets, and a
        # group's rows right-padded to its longest; the 3 slots' prompts differ in length).
        padded = {part: int(n) for part, n in re.findall(r"^  (prefill.*?) +\d+\.\d+ .*; fed (\d+) with padding",
                                                          profile, re.M)}
        assert sorted(padded) == sorted(fed) and all(padded[p] >= fed[p] for p in fed), (padded, fed)
        steps = int(re.search(r"(\d+) steps in \1 chunks", profile).group(1))  # one step a chunk on CPU
        assert steps >= tokens / 3, "3 slots make at most 3 tokens a step"
        summed = float(re.search(r"sum of the parts +(\d+\.\d+)", profile).group(1))
        assert summed == pytest.approx(sum(parts.values()), abs=0.005)
        assert summed == pytest.approx(wall, rel=0.02, abs=0.02)
        idle = float(re.search(r"device idle: the wall less its spans +(\d+\.\d+)", profile).group(1))
        in_drain = parts["host scheduling (device waits, in a drain)"]
        assert idle == pytest.approx(in_drain + parts["between drains (the caller's calls)"], abs=0.002)
        # Streamed: the turn scheduler holds each answer inside the one drain, between its spans.
        caller = re.search(r"the caller's turns inside the drain \(host clock.*\): (\d+\.\d+) s for (\d+) answers",
                           profile)
        # Nested intervals of one clock, each value rounded to a millisecond in the table.
        assert int(caller.group(2)) == answered and 0 <= float(caller.group(1)) <= idle + 0.002
        read, rate = re.search(r"KV read (\d+\.\d) MB a step: (\d+\.\d) GB/s", profile).groups()
        assert float(read) > 0 and float(rate) > 0


@pytest.mark.parametrize("kind", ["engine", "hf"])
def test_no_prompt_starts_after_the_deadline(smollm2, prompts, monkeypatch, kind):
    """The deadline passes once the first 4 prompts have started: those are answered as
    without one (the 4 longest: both generators start the longest first), the rest are
    None; a deadline already past starts nothing."""
    import types

    import data_gen.engine
    import data_gen.generators

    clock = Clock()
    monkeypatch.setattr(data_gen.generators, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    some = prompts[:12]
    cfg, s = BackendConfig(kind=kind, batch_size=4), SamplingConfig(max_new_tokens=MAX_NEW)
    gen = (EngineGenerator(smollm2, cfg, s, [IM_END], max_prompt_len=256) if kind == "engine"
           else HFGenerator(smollm2, cfg, s, [IM_END], IM_END))
    assert gen.generate(some, list(range(12)), deadline=clock.now) == [None] * 12
    # The clock passes the deadline as soon as the first group of prompts has started.
    cls, name = (data_gen.engine.GenerationEngine, "_admit") if kind == "engine" else (HFGenerator, "_batch")
    started = getattr(cls, name)

    def then_late(self, *args):
        out = started(self, *args)
        clock.now += 3600
        return out

    monkeypatch.setattr(cls, name, then_late)
    results = gen.generate(some, list(range(12)), deadline=clock.now + 60)
    longest = sorted(range(12), key=lambda i: -len(some[i]))[:4]
    assert [i for i, r in enumerate(results) if r is not None] == sorted(longest)
    monkeypatch.setattr(cls, name, started)
    full = generate(kind, smollm2, [some[i] for i in sorted(longest)], batch_size=4)
    assert [results[i].ids for i in sorted(longest)] == [c.ids for c in full]
    if kind == "engine":
        assert not gen.engine.queue, "the prompts the deadline kept out are not left queued"
