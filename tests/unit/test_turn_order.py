"""The turn scheduler's order (data_gen/turns.py): among the turns ready, the conversation with
the most turns left goes first, and shards open ahead while fewer than `lookahead`
conversations are open; the rows do not depend on the order. Driven through the pipeline's
own generate_shards with SmolLM2's real tokenizer and chat template, answered by the slot
model of benchmarks/turn_schedule.py (fixed-length answers, counted in decode steps)."""

import json

import pytest

from benchmarks.turn_schedule import SlotModel
from data_gen.config import to_datagen_config
from data_gen.generators import Completion
from data_gen.pipeline import setup
from data_gen.turns import generate_shards
from tests.conftest import SMOLLM2

ANSWER = 5  # tokens an answer takes, its stop token included
LONG_TURNS = 4


def job(tmp_path, tokenizer, singles: int):
    """`singles` one-turn conversations, then one of LONG_TURNS turns, one a shard."""
    src = tmp_path / "conversations.jsonl"
    rows = [[f"What is {i} plus {i}?"] for i in range(singles)]
    rows.append([f"Tell me about the number {t}." for t in range(LONG_TURNS)])
    src.write_text("\n".join(json.dumps({"messages": [m for u in users for m in
                                                      ({"role": "user", "content": u},
                                                       {"role": "assistant", "content": "old"})]})
                             for users in rows))
    cfg = to_datagen_config({
        "target": {"name": SMOLLM2}, "out_dir": str(tmp_path / "out"), "exclude_eval": [], "shard_size": 1,
        "sources": [{"kind": "jsonl", "path": str(src)}], "template": {"max_turns": None},
        "sampling": {"max_new_tokens": 16}, "backend": {"kind": "hf", "batch_size": 2}})
    _, _, _, shaper, prompts, _ = setup(cfg, tokenizer)
    return cfg, shaper, {k: [p] for k, p in enumerate(prompts)}


def run(cfg, shaper, shards, lookahead):
    """(rows by shard, the keys in the order asked, the model): 2 slots, the host one step behind."""
    asked = []

    def answer(key, prompt):
        asked.append(key)
        return Completion([100 + len(prompt) % 50] * (ANSWER - 1) + [shaper.stop_ids[0]], "stop")

    model = SlotModel(slots=2, sync_steps=1, answer=answer)
    done = {k: rows for k, rows, _ in generate_shards(cfg, shaper, model, shards, call_size=2, lookahead=lookahead)}
    return done, asked, model


@pytest.mark.parametrize("singles", [2, 7])
def test_the_longest_conversation_starts_first_and_the_job_ends_sooner(tmp_path, smollm2_tokenizer, singles):
    """Single turns in shards 0..n-1, the four-turn conversation in the last shard, 2 slots.
    An answer holds its slot ANSWER steps plus one (the host reads the slots a step behind),
    so the job cannot end before the longest of: the conversation's chain of answers, one
    after another (4 x 6 steps), and all the answers' slot-steps over 2 slots. With the shards
    open ahead, the conversation's first turn is the first asked and the job ends at that
    bound (2 singles: the chain decides; 7: the slots do); opening shards only as the slots
    need turns (the order before) starts it last and ends later. The rows are the same."""
    cfg, shaper, shards = job(tmp_path, smollm2_tokenizer, singles)
    last = len(shards) - 1
    ahead_rows, ahead, fast = run(cfg, shaper, shards, lookahead=len(shards))
    late_rows, late, slow = run(cfg, shaper, shards, lookahead=0)
    assert ahead[0] == (last, 0) and ahead.count((last, 0)) == LONG_TURNS
    assert late.index((last, 0)) == singles, "opened as the slots needed turns, it came last"
    assert ahead_rows == late_rows and len(ahead_rows) == len(shards)
    held = ANSWER + 1
    assert fast.steps == max(LONG_TURNS * held, -(-(singles + LONG_TURNS) // 2) * held) == (24 if singles == 2 else 36)
    assert slow.steps > fast.steps
    assert fast.live == slow.live == (singles + LONG_TURNS) * ANSWER


def test_single_turn_jobs_keep_the_shards_order(tmp_path, smollm2_tokenizer):
    """With one turn each every conversation ties on turns left: the order is the shards'."""
    cfg, shaper, shards = job(tmp_path, smollm2_tokenizer, 5)
    cfg.template.max_turns = 1
    _, _, _, shaper, prompts, _ = setup(cfg, smollm2_tokenizer)
    shards = {k: [p] for k, p in enumerate(prompts)}
    _, asked, _ = run(cfg, shaper, shards, lookahead=len(shards))
    assert asked == [(k, 0) for k in range(len(shards))]


def test_the_benchmark_replays_a_real_job(capsys):
    """benchmarks/turn_schedule.py on SmolLM2's tokenizer and ShareGPT's first conversations:
    every turn answered (the corpus's replies), never fewer steps than the tokens need, and a
    kept slot prefills less than the whole conversations."""
    from benchmarks.turn_schedule import main

    main(["--target", SMOLLM2, "--conversations", "12", "--single", "12", "--slots", "4", "--max-new-tokens", "64",
          "--max-prompt-len", "1024", "--shard-size", "4"])
    out = capsys.readouterr().out
    assert out.startswith("24 prompts (12 conversations, 12 single turns) in 6 shards of 4, 4 slots")
    cells = [c.strip() for c in out.splitlines()[-1].strip("|").split("|")]
    answers, tokens, steps, ideal = (int(c.replace(",", "")) for c in cells[:4])
    prefilled, kept = (int(x.strip("()").replace(",", "")) for x in cells[6].split())
    assert answers > 24 and steps >= ideal == round(tokens / 4) and 0 < kept < prefilled


# A template whose history cannot be masked: after each assistant turn it writes the answer's
# length, so the text after an answer depends on its content (ChatShaper refuses that mask).
COUNTING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% if m['role'] == 'assistant' %}({{ m['content'] | length }})\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_turn_the_template_cannot_mask_ends_the_conversation_before_it(tmp_path, smollm2_tokenizer):
    """Turns are asked with their ids alone and a row's mask is built as it is written; where
    the template renders a later turn but cannot mask it, the row is the turn before the first
    such one, as when every ask built its mask (the conversation ended there): its prompt,
    its mask and its answer, and the conversation counted as ended by the template."""
    cfg, shaper, shards = job(tmp_path, smollm2_tokenizer, singles=1)
    template = tmp_path / "counting.jinja"
    template.write_text(COUNTING)
    cfg.template.chat_template = str(template)
    _, _, _, shaper, prompts, _ = setup(cfg, smollm2_tokenizer)
    assert not shaper.uses_markers
    shards = {k: [p] for k, p in enumerate(prompts)}
    metas = {}
    asked = []

    def answer(key, prompt):
        asked.append(key)
        return Completion([100 + len(prompt) % 50] * (ANSWER - 1) + [shaper.stop_ids[0]], "stop")

    model = SlotModel(slots=2, sync_steps=1, answer=answer)
    rows = {}
    for k, shard_rows, meta in generate_shards(cfg, shaper, model, shards, call_size=2, lookahead=len(shards)):
        rows[k], metas[k] = shard_rows, meta
    long = prompts[-1]
    assert asked.count((1, 0)) == LONG_TURNS  # every turn renders, so every turn was asked
    (row,) = rows[1]
    ids, mask = shaper.prompt(long.system, long.user_turns, [])  # the first turn's prompt
    reply = [100 + len(ids) % 50] * (ANSWER - 1) + [shaper.stop_ids[0]]
    assert row["input_ids"] == ids + reply and row["loss_mask"] == mask + [1] * ANSWER
    assert (row["prompt_len"], row["finish_reason"]) == (len(ids), "stop")
    assert metas[1]["ended_early"] == {"template_error: ValueError": 1}
    assert metas[1]["generated_tokens"] == LONG_TURNS * ANSWER
    with pytest.raises(ValueError, match="depends on its content"):
        shaper.prompt(long.system, long.user_turns, [reply])
    (single,) = rows[0]  # a one-turn conversation needs no history mask
    assert metas[0]["ended_early"] == {} and single["response_len"] == ANSWER
