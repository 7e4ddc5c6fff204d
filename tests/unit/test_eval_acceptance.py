import pytest
import torch

from dflash_train.eval.acceptance import (
    PromptResult,
    common_prefix,
    length_histogram,
    mean_acceptance,
    position_acceptance,
    summarize,
    target_generate,
    top2_gap_ulps,
    trim_output,
)

LENGTHS = [1, 3, 4, 1, 2]  # block size 4


def test_mean_acceptance():
    assert mean_acceptance(LENGTHS) == 11 / 5
    assert mean_acceptance([]) == 0.0


def test_length_histogram():
    assert length_histogram(LENGTHS, 4) == [2, 1, 1, 1]
    assert length_histogram([], 3) == [0, 0, 0]
    with pytest.raises(ValueError, match=r"acceptance lengths \[5\] outside 1..4"):
        length_histogram([1, 5], 4)
    with pytest.raises(ValueError, match=r"\[0\] outside"):
        length_histogram([0], 4)


def test_position_acceptance():
    # accepted drafts per step: 0, 2, 3, 0, 1
    assert position_acceptance(LENGTHS, 4) == [3 / 5, 2 / 5, 1 / 5]
    assert 1 + sum(position_acceptance(LENGTHS, 4)) == pytest.approx(mean_acceptance(LENGTHS))
    assert position_acceptance([], 4) == [0.0, 0.0, 0.0]


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix([1, 2, 3], [1, 9, 3]) == 1
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [4]) == 0


def test_trim_output():
    assert trim_output([5, 6, 2, 7, 8], 10, [2]) == [5, 6, 2]
    assert trim_output([5, 6, 2, 7, 8], 2, [2]) == [5, 6]
    assert trim_output([5, 6, 7], 10, None) == [5, 6, 7]


def _result(pid, lengths, spec, plain, spec_s, plain_s):
    return PromptResult(pid, 10, lengths, spec, plain, spec_s, plain_s)


def test_summarize_exact_numbers():
    results = [
        _result("a", [1, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9], 1.0, 3.0),
        _result("b", [1, 2], [1, 2, 3, 4], [1, 2, 9, 9, 9, 9], 1.0, 1.0),
    ]
    s = summarize(results, block_size=4, greedy=True)
    assert s["num_prompts"] == 2 and s["num_steps"] == 5
    assert s["tau"] == 11 / 5
    assert s["length_histogram"] == [2, 1, 1, 1]
    assert s["position_acceptance"] == [3 / 5, 2 / 5, 1 / 5]
    assert s["greedy_agreement"] == 0.5
    assert s["token_agreement"] == (9 + 2) / (9 + 6)
    assert (s["spec_tokens"], s["plain_tokens"]) == (13, 15)
    assert s["spec_tok_s"] == 13 / 2.0 and s["plain_tok_s"] == 15 / 4.0
    assert s["speedup"] == pytest.approx((13 / 2.0) / (15 / 4.0))
    d = results[1].to_dict()
    assert d["tau"] == 1.5 and d["exact_match"] is False and d["first_divergence"] == 2
    assert results[0].to_dict()["first_divergence"] is None


def test_top2_gap_in_rounding_steps():
    # bf16 values near 20 are spaced 2**4 * 2**-7 = 0.125 apart: a gap of 0.25 is 2 steps
    assert top2_gap_ulps(torch.tensor([[1.0, 20.0, 19.75]], dtype=torch.bfloat16)) == 2.0
    # the same float32 logits, rounded by a bf16 model: still counted in bf16 steps
    assert top2_gap_ulps(torch.tensor([[19.75, 20.0, -3.0]]), torch.bfloat16) == 2.0
    assert top2_gap_ulps(torch.tensor([[-0.75, -0.5]])) == 0.25 / 2**-24  # |top| in [0.5, 1)
    assert top2_gap_ulps(torch.tensor([[3.0, 3.0]])) == 0.0


def test_divergences_are_classified_by_the_plain_top2_gap():
    gaps = [50.0, 40.0, 1.0, 30.0]
    tie = PromptResult("tie", 10, [1, 1, 1, 1], [1, 2, 3, 4], [1, 2, 9, 9], 1.0, 1.0, gaps)
    bug = PromptResult("bug", 10, [1, 1], [5, 6], [7, 6], 1.0, 1.0, [12.0, 3.0])
    same = PromptResult("same", 10, [1], [1], [1], 1.0, 1.0, [0.0])
    short = PromptResult("short", 10, [1], [1], [1, 2], 1.0, 1.0, [9.0, 9.0])  # spec stopped early
    assert [r.divergence_gap_ulps for r in (tie, bug, same)] == [1.0, 12.0, None]
    assert short.divergence_gap_ulps is None
    assert tie.to_dict()["divergence_gap_ulps"] == 1.0
    s = summarize([tie, bug, same, short], block_size=4, greedy=True)
    assert (s["divergent_prompts"], s["near_tie_divergences"]) == (3, 1)
    assert summarize([tie], block_size=4, greedy=False)["divergent_prompts"] is None


def test_summarize_counts_turns_and_step_times():
    times = {"draft": 0.5, "verify": 1.0, "bookkeeping": 0.25}
    first = PromptResult("q", 10, [2, 2], [1, 2, 3, 4], [1, 2, 3, 4], 1.0, 1.0, step_times=times)
    second = PromptResult("q", 30, [4, 1, 1], [5, 6, 7, 8, 9, 9], [5, 6, 7, 8, 9, 9], 1.0, 1.0, turn=2,
                          step_times=times)
    s = summarize([first, second], block_size=4, greedy=True)
    assert (s["num_prompts"], s["num_turns"], s["num_steps"]) == (1, 2, 5)
    assert s["tau_by_turn"] == {"1": 2.0, "2": 2.0} and s["tau"] == 10 / 5
    assert s["step_times"]["seconds"] == {"draft": 1.0, "verify": 2.0, "bookkeeping": 0.5}
    assert s["step_times"]["ms_per_step"] == {"draft": 200.0, "verify": 400.0, "bookkeeping": 100.0}
    assert second.to_dict()["turn"] == 2 and second.to_dict()["step_times"] == times
    untimed = PromptResult("u", 10, [1], [1], [1], 1.0, 1.0)
    assert summarize([first, untimed], block_size=4, greedy=True)["step_times"] is None


def test_summarize_sampling_has_no_agreement():
    s = summarize([_result("a", [2], [1, 2], [3, 4], 1.0, 1.0)], block_size=4, greedy=False)
    assert s["greedy_agreement"] is None and s["token_agreement"] is None


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).eval()


def test_target_generate_matches_hf_greedy(tiny_llama):
    prompt = torch.tensor([[3, 17, 42, 8, 25]])
    ours = target_generate(tiny_llama, prompt, max_new_tokens=12)
    ref = tiny_llama.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ours.shape == (1, 17)
    assert ours.tolist() == ref.tolist()
    assert torch.is_inference(ours)  # the baseline decodes without autograd, as spec_generate does
    gaps = []
    target_generate(tiny_llama, prompt, max_new_tokens=12, gaps_ulps=gaps)
    scores = tiny_llama.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,
                                 eos_token_id=None, pad_token_id=0, output_scores=True,
                                 return_dict_in_generate=True).scores
    assert gaps == pytest.approx([top2_gap_ulps(step) for step in scores], rel=1e-3)


def test_target_generate_stops_after_stop_token(tiny_llama):
    prompt = torch.tensor([[3, 17, 42, 8, 25]])
    full = target_generate(tiny_llama, prompt, max_new_tokens=12)[0, 5:].tolist()
    stop = full[3]
    first = full.index(stop)
    out = target_generate(tiny_llama, prompt, max_new_tokens=12, stop_token_ids=[stop])
    assert out[0, 5:].tolist() == full[: first + 1]


def test_target_generate_sampling_is_seeded(tiny_llama):
    prompt = torch.tensor([[1, 2, 3]])
    torch.manual_seed(7)
    a = target_generate(tiny_llama, prompt, max_new_tokens=8, temperature=1.0)
    torch.manual_seed(7)
    b = target_generate(tiny_llama, prompt, max_new_tokens=8, temperature=1.0)
    assert a.tolist() == b.tolist() and a.shape == (1, 11)
