"""The static runtime's per-step cost breakdown (eval/breakdown.py, `eval.speed step_timing=true`)
on a CPU: the parts add up to the decode, the laps change nothing, the counts are the ops
each part really dispatches, and the flag prints the table for the real SmolLM2 target."""

import pytest
import torch

from dflash_train.eval.breakdown import PARTS, PartClock, format_breakdown, step_breakdown
from dflash_train.model.dflash import NO_CLOCK, DFlashConfig, DFlashDraftModel, Sampling
from dflash_train.model.runtime import speculate_static
from tests.conftest import make_tiny_target

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def models():
    target = make_tiny_target("qwen3")
    torch.manual_seed(0)
    drafter = DFlashDraftModel(DFlashConfig.from_target(target.config, mask_token_id=96, num_hidden_layers=1,
                                                        block_size=4)).eval()
    return target, drafter


def _prompts():
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, 90, (1, n), generator=g) for n in (7, 11)]


@pytest.mark.usefixtures("one_thread")
def test_the_parts_add_up_to_the_decode_and_change_nothing(models):
    target, drafter = models
    ids = _prompts()[0]
    plain = speculate_static(drafter, target, ids, NEW_TOKENS, Sampling(), [], None, None, NO_CLOCK)
    clock = PartClock(ids.device)
    timed = speculate_static(drafter, target, ids, NEW_TOKENS, Sampling(), [], None, None, clock)
    assert torch.equal(timed.output_ids, plain.output_ids)
    assert timed.acceptance_lengths == plain.acceptance_lengths
    result = clock.result()
    assert result["steps"] == len(timed.acceptance_lengths) and result["device_s"] is None  # no CUDA events on a CPU
    assert set(result["host_s"]) == set(PARTS) and all(t > 0 for t in result["host_s"].values())
    # every lap of a step is a part: only the loop's condition lies between them
    assert 0.8 * timed.decode_s < sum(result["host_s"].values()) <= timed.decode_s


@pytest.mark.usefixtures("one_thread")
def test_breakdown_counts_the_ops_each_part_dispatches(models):
    target, drafter = models
    b = step_breakdown(drafter, target, _prompts(), NEW_TOKENS)
    assert b["device"] == "cpu" and b["prompts"] == 2 and b["kernels_per_step"] is None
    assert 1.0 <= b["tau"] <= drafter.block_size and b["plain_step_ms"] > 0
    parts = b["parts"]
    assert list(parts) == list(PARTS)
    # bookkeeping: the next context features and positions copied in, the anchor viewed
    assert parts["bookkeeping"]["ops"] == 3
    # host: the accepted count, the bonus token and the drafts concatenated for the one copy
    assert parts["host"]["ops"] >= 1
    # the forwards dispatch far more: the drafter's layer and the target's six
    assert parts["verify"]["ops"] > parts["draft"]["ops"] > 20
    assert all(p["kernels"] == p["launches"] == 0 and p["device_ms"] is None for p in parts.values())
    lines = format_breakdown(b).splitlines()
    assert lines[0].startswith(f"per speculative step, static runtime (2 prompts, {b['steps']} steps, tau ")
    assert lines[1].split() == ["part", "host", "ms", "device", "ms", "ops", "kernels", "launches"]
    assert [line.split()[0] for line in lines[3:9]] == [*PARTS, "step"]
    assert lines[7].split()[2:] == ["-", "3", "-", "-"]  # bookkeeping
    # the device loop decodes the same steps: on a CPU it costs about what the laps add up to
    assert lines[-2] == (f"the device loop (greedy, untimed: every step decided on the device, one graph a step on a "
                         f"GPU): {b['loop_step_ms']:.2f} ms a step = {b['loop_step_ms'] / b['plain_step_ms']:.2f} "
                         f"plain steps")
    step_ms = sum(p["host_ms"] for p in parts.values())
    assert 0.5 * step_ms < b["loop_step_ms"] < 2 * step_ms
    assert lines[-1] == "on a CPU host ms is the compute; device times and kernel counts need a GPU"


def test_speed_prints_the_breakdown_for_smollm2(capsys):
    from dflash_train.eval.speed import run

    run(["drafter_path=random", "drafter=cpu_small", "datasets=[mtbench]", "limit=1", "max_new_tokens=6",
         "step_timing=true", "runtime=static", "target.dtype=float32"])
    out = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(out) if line.startswith("per speculative step, static runtime"))
    assert out[start].startswith("per speculative step, static runtime (1 prompts, ")
    assert " plain steps of " in out[start]
    rows = {line.split()[0]: line.split()[1:] for line in out[start + 3 : start + 9]}
    assert list(rows) == [*PARTS, "step"]
    assert all(float(r[0]) > 0 for r in rows.values()) and rows["bookkeeping"][2] == "3"


def test_speed_refuses_a_breakdown_without_steps():
    from dflash_train.eval.speed import run

    with pytest.raises(ValueError, match="step_timing=true needs max_new_tokens >= 2, got 1"):
        run(["drafter_path=random", "max_new_tokens=1", "step_timing=true"])
