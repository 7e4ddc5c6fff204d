"""Every turn regenerated, on the real SmolLM2 target: each assistant turn is answered on the
target's own earlier answers, the loss mask covers exactly those answers, and a
conversation's next turn shares a generate call with other conversations' first turns."""

import json

import pytest
import torch

from data_gen.config import to_datagen_config
from data_gen.build import build_generator
from data_gen.pipeline import run, setup
from data_gen.turns import generate_shards, turn_seed
from dflash_train.data.format import load_generated, read_manifest
from tests.conftest import SMOLLM2
from tests.datagen_helpers import an_hour_after_each_batch

# one thread: tiny matmuls do not split, and on a shared CPU the second thread waits
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
MAX_NEW = 8
IM_END, IM_START = 2, 1
OLD = "AN ORIGINAL ANSWER"
CONVERSATIONS = [
    ["What is 2+2? Answer with one number.", "Add 3 to it. Answer with one number.", "Double it. One number."],
    ["Name a color. One word only."],
    ["Is the sky blue? Answer yes or no.", "Is grass green? Answer yes or no."],
    ["What is 1+1? Answer with one number.", "Add 1. Answer with one number.", "Is it 3? Answer yes or no."],
    ["What is 5+1? Answer with one number.", "Is it even? Answer yes or no."],
]


def config(tmp_path, name, **overrides):
    src = tmp_path / "conversations.jsonl"
    lines = []
    for users in CONVERSATIONS:
        messages = []
        for u in users:
            messages += [{"role": "user", "content": u}, {"role": "assistant", "content": OLD}]
        lines.append(json.dumps({"messages": messages}))
    src.write_text("\n".join(lines))
    cfg = {"target": {"name": SMOLLM2}, "out_dir": str(tmp_path / name), "exclude_eval": [],
           "sources": [{"kind": "jsonl", "path": str(src)}], "shard_size": 2, "template": {"max_turns": None},
           "sampling": {"max_new_tokens": MAX_NEW}, "backend": {"kind": "hf", "batch_size": 2, "cpu_threads": 1},
           **overrides}
    return to_datagen_config(cfg)


def reference(model, shaper, prompt, max_prompt_len=10**9):
    """Turn by turn, one unpadded prompt at a time: the answers and the last prompt."""
    answers = []
    for _ in prompt.user_turns:
        ids, mask = shaper.prompt(prompt.system, prompt.user_turns, answers)
        if len(ids) > max_prompt_len:
            break
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=IM_END,
                             eos_token_id=IM_END)[0, len(ids):].tolist()
        answers.append(out[: out.index(IM_END) + 1] if IM_END in out else out)
        last = (ids, mask)
        if answers[-1][-1] != IM_END:
            break
    return answers, last


def spans(mask):
    """(start, end) of each run of ones."""
    out, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


@pytest.fixture(scope="module")
def turns_run(tmp_path_factory, smollm2, smollm2_tokenizer):
    cfg = config(tmp_path_factory.mktemp("turns"), "all")
    run(cfg, target=smollm2, tokenizer=smollm2_tokenizer, progress=False)
    _, _, _, shaper, prompts, _ = setup(cfg, smollm2_tokenizer)
    refs = [reference(smollm2.model, shaper, p) for p in prompts]
    return cfg, shaper, prompts, refs, load_generated(cfg.out_dir)


def test_every_answer_is_regenerated_and_learned_exactly(turns_run, smollm2_tokenizer):
    cfg, shaper, prompts, refs, data = turns_run
    tok = smollm2_tokenizer
    assert data["prompt_id"] == [p.prompt_id for p in prompts] and len(data) == len(CONVERSATIONS)
    assert [len(a) for a, _ in refs] == [3, 1, 2, 3, 2], "fixture: every conversation reaches its last turn"
    for p, (answers, (ids, mask)), row in zip(prompts, refs, data):
        assert row["input_ids"] == ids + answers[-1] and row["loss_mask"] == mask + [1] * len(answers[-1])
        # One learned span per answer and nothing else: not the system prompt, the user
        # turns or the role headers. Earlier answers went through the template as text.
        learned = spans(row["loss_mask"])
        assert len(learned) == len(answers)
        for (a, b), answer in zip(learned, answers):
            assert tok.decode(row["input_ids"][a:b]) == tok.decode(answer)
        assert row["input_ids"][learned[-1][0]:] == answers[-1]
        # The next turn sees the target's answer, never the corpus's.
        text = tok.decode(row["input_ids"])
        assert OLD not in text
        for answer, user in zip(answers, p.user_turns[1:]):
            assert f"assistant\n{tok.decode(answer)}\n<|im_start|>user\n{user}<|im_end|>" in text
    counts = read_manifest(cfg.out_dir)["counts"]
    # The last answer of one conversation runs past MAX_NEW; no conversation ended early.
    assert counts["rows"] == 5 and counts["finish_reasons"] == {"stop": 4, "length": 1}
    assert counts["ended_early"] == {}


class Recorder:
    """The real hf generator, remembering which turn of which prompt each call carried."""

    def __init__(self, inner, tokenizer):
        self.inner, self.tokenizer, self.calls = inner, tokenizer, []

    def generate(self, prompts, seeds, deadline=None):
        # SmolLM2's template: turn t of a conversation holds 2t + 3 <|im_start|> (system, users,
        # answers, the generation header); the first user turn names the conversation.
        turns = [(p.count(IM_START) - 3) // 2 for p in prompts]
        firsts = [self.tokenizer.decode(p).split("<|im_start|>user\n")[1].split("<|im_end|>")[0] for p in prompts]
        self.calls.append([(CONVERSATIONS.index(next(c for c in CONVERSATIONS if c[0] == f)), t)
                           for f, t in zip(firsts, turns)])
        return self.inner.generate(prompts, seeds, deadline)


def test_next_turn_joins_the_next_call(turns_run, smollm2, smollm2_tokenizer):
    """Calls of two prompts over shards of two conversations (of 3 and 1, 2 and 3, then 2 turns):
    a begun conversation's next turn goes into the very next call, ahead of any other; of the
    conversations not begun, the one with more turns starts first (3 before 2, though later in
    its shard), and a shard is committed as soon as its conversations end."""
    cfg, shaper, prompts, _, data = turns_run
    generator = Recorder(build_generator(cfg.backend, cfg.sampling, SMOLLM2, shaper.stop_ids, IM_END,
                                         smollm2_tokenizer, target=smollm2), smollm2_tokenizer)
    shards = {k: prompts[2 * k:2 * k + 2] for k in range(3)}
    done = list(generate_shards(cfg, shaper, generator, shards, call_size=2))
    assert generator.calls == [[(0, 0), (1, 0)], [(0, 1), (3, 0)], [(3, 1), (0, 2)], [(3, 2), (2, 0)],
                               [(2, 1), (4, 0)], [(4, 1)]]
    assert [k for k, _, _ in done] == [0, 1, 2]
    assert [r for _, rows, _ in sorted(done, key=lambda d: d[0]) for r in rows] == data.to_list()


def test_a_turn_past_max_prompt_len_ends_the_conversation_and_keeps_the_row(tmp_path, turns_run, smollm2,
                                                                             smollm2_tokenizer):
    """The third prompt of conversation 0 is one token too long: its row keeps two answers."""
    _, shaper, prompts, refs, _ = turns_run
    third = shaper.prompt(prompts[0].system, prompts[0].user_turns, refs[0][0][:2])[0]
    cfg = config(tmp_path, "cut", max_prompt_len=len(third) - 1, num_prompts=1)
    run(cfg, target=smollm2, tokenizer=smollm2_tokenizer, progress=False)
    answers, (ids, _) = reference(smollm2.model, shaper, prompts[0], max_prompt_len=len(third) - 1)
    row = load_generated(cfg.out_dir)[0]
    assert len(answers) == 2 and row["input_ids"] == ids + answers[-1]
    assert read_manifest(cfg.out_dir)["counts"]["ended_early"] == {"too_long": 1}


def test_a_budget_ends_each_conversation_at_its_last_answer(tmp_path, smollm2, smollm2_tokenizer, turns_run,
                                                           monkeypatch):
    """budget_min runs out after the first batch of the first call (2 prompts of 5 first turns):
    their conversations end after one answer, each row equal to the unbudgeted run's first
    turn; the shards begun are written, the last (not begun) is not; a rerun adds nothing."""
    from data_gen.hf_generator import HFGenerator

    first_batch = an_hour_after_each_batch(monkeypatch)
    cfg = config(tmp_path, "budget", budget_min=1.0)
    result = run(cfg, target=smollm2, tokenizer=smollm2_tokenizer, progress=False)
    _, shaper, prompts, refs, _ = turns_run
    # Shards of 2: {0, 1}, {2, 3}, {4}. The longest first prompts (0 and 3) made the first batch.
    manifest = read_manifest(cfg.out_dir)
    assert manifest["budget"] == {"minutes": 1.0, "reached": True, "shards": 2, "of": 3, "prompts_unstarted": 3}
    assert result.budget_reached and result.unstarted == 3 and not result.complete
    data = load_generated(cfg.out_dir)
    assert data["prompt_id"] == [prompts[0].prompt_id, prompts[3].prompt_id]
    for i, row in zip((0, 3), data):
        ids, mask = shaper.prompt(prompts[i].system, prompts[i].user_turns, [])
        assert row["input_ids"] == ids + refs[i][0][0] and row["loss_mask"] == mask + [1] * len(refs[i][0][0])
    counts = manifest["counts"]
    assert counts["rows"] == 2 and counts["ended_early"] == {"budget": 2} and counts["skipped"] == {"budget": 2}
    assert json.loads((tmp_path / "budget" / "budget.json").read_text())["seconds"] == pytest.approx(3600.0)
    # The same command again: the dataset is final, nothing is generated.
    monkeypatch.setattr(HFGenerator, "_batch", first_batch)
    before = {p: p.read_bytes() for p in (tmp_path / "budget").rglob("*") if p.is_file()}
    again = run(cfg, target=smollm2, tokenizer=smollm2_tokenizer, progress=False)
    assert again.budget_reached and again.generated_tokens == 0
    assert {p: p.read_bytes() for p in (tmp_path / "budget").rglob("*") if p.is_file()} == before


def test_an_answer_cut_at_max_new_tokens_ends_its_conversation_early(tmp_path, turns_run, smollm2, smollm2_tokenizer):
    """With 2 new tokens every first answer is cut: it is not a history to continue from, so
    each conversation is one row of one answer, and the four with turns left count as ended
    early (the one-turn conversation does not)."""
    _, shaper, prompts, _, _ = turns_run
    cfg = config(tmp_path, "short", sampling={"max_new_tokens": 2})
    run(cfg, target=smollm2, tokenizer=smollm2_tokenizer, progress=False)
    data = load_generated(cfg.out_dir)
    for p, row in zip(prompts, data):
        ids, mask = shaper.prompt(p.system, p.user_turns, [])
        assert row["input_ids"][:len(ids)] == ids and row["response_len"] == 2  # the first turn, cut
    counts = read_manifest(cfg.out_dir)["counts"]
    assert counts["finish_reasons"] == {"length": 5} and counts["ended_early"] == {"max_new_tokens": 4}


def test_each_turn_samples_from_its_own_seed(turns_run, smollm2, smollm2_tokenizer):
    """Sampled multi-turn runs: turn t of a prompt draws from turn_seed(seed, prompt, t), a
    stream of its own (not turn 0's again), whatever call the turn lands in."""
    cfg, shaper, prompts, _, _ = turns_run
    seen = {}

    class Seeds:
        def __init__(self, inner):
            self.inner = inner

        def generate(self, batch, seeds, deadline=None):
            for ids, seed in zip(batch, seeds):
                first = smollm2_tokenizer.decode(ids).split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
                seen[(first, (ids.count(IM_START) - 3) // 2)] = seed
            return self.inner.generate(batch, seeds, deadline)

    generator = Seeds(build_generator(cfg.backend, cfg.sampling, SMOLLM2, shaper.stop_ids, IM_END,
                                      smollm2_tokenizer, target=smollm2))
    list(generate_shards(cfg, shaper, generator, {0: prompts}, call_size=2))
    expected = {(p.user_turns[0], t): turn_seed(cfg.sampling.seed, p, t)
                for p in prompts for t in range(len(p.user_turns))}
    assert seen == expected and len(set(expected.values())) == len(expected)
