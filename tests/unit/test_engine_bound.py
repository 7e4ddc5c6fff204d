"""benchmarks/engine_bound.py: the turns read from loss masks, and the replay's counts on
examples worked out by hand."""

from benchmarks import engine_bound as eb
from dflash_train.model.target import load_tokenizer
from tests.conftest import SMOLLM2
from tests.train_data import write_datagen_dir


def test_answer_spans_are_the_runs_of_ones():
    assert eb.answer_spans([0, 0, 1, 1, 1, 0, 0, 1, 1]) == [(2, 3), (7, 2)]
    assert eb.answer_spans([1, 0, 1]) == [(0, 1), (2, 1)]
    assert eb.answer_spans([0, 0]) == []


def test_one_slot_one_answer():
    # prompt 2, answer 3: positions 2, 3, 4 are decoded. flex reads blocks of 4 columns:
    # 4, 4, 8; sdpa the width covering position + 2 * sync + 1 in steps of 4: 8, 8, 8.
    r = eb.replay([[(2, 3)]], slots=1, width_step=4, block=4, sync_steps=1, max_len=64)
    assert (r.steps, r.tokens, r.flex_kv, r.sdpa_kv, r.prefill, r.prefill_kept) == (3, 3, 16, 24, 2, 2)


def test_a_next_turn_waits_for_its_answer_and_a_kept_cache_prefills_only_the_new_tokens():
    # turn 2's prompt (6) holds turn 1's prompt (2) and answer (1) and 3 new tokens
    r = eb.replay([[(2, 1), (6, 2)]], slots=2, width_step=4, block=4, sync_steps=0, max_len=64)
    assert (r.steps, r.tokens, r.prefill, r.prefill_kept) == (3, 3, 8, 5)
    # idle slots count for sdpa only: 2 slots x widths 4, 8, 8
    assert r.sdpa_kv == 2 * (4 + 8 + 8) and r.flex_kv == 4 + 8 + 8


def test_slots_run_side_by_side_and_a_freed_slot_takes_the_queue():
    conversations = [[(1, 2)], [(1, 1)], [(1, 1)]]
    r = eb.replay(conversations, slots=2, width_step=4, block=4, sync_steps=0, max_len=64)
    assert (r.steps, r.tokens) == (2, 4)
    assert eb.replay(conversations, slots=1, width_step=4, block=4, sync_steps=0, max_len=64).steps == 4


def test_the_cli_replays_a_real_data_set(tmp_path, capsys):
    tok = load_tokenizer(SMOLLM2)
    data = write_datagen_dir(tmp_path / "data", SMOLLM2, tok)
    from dflash_train.data.format import load_generated

    answers = sum(sum(load_generated(data)["loss_mask"], []))
    eb.main([str(data), "--slots", "4", "--measured-s", "2"])
    out = capsys.readouterr().out
    assert out.startswith(f"{answers:,} answer tokens in ")
    assert "| sdpa |" in out and "| flex |" in out and f"{answers / 2 / 1e3:.1f}K tok/s" in out
