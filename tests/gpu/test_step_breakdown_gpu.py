"""GPU: the per-step breakdown's device side (CUDA events, kernel and launch counts) on the
static runtime's captured graphs."""

import copy

import pytest
import torch

from dflash_train.eval.breakdown import PARTS, format_breakdown, step_breakdown
from tests.unit.test_runtime_drafter import prompts, target, trained  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_breakdown_times_and_counts_the_graphs(target, trained, prompts):  # noqa: F811
    model, drafter = copy.deepcopy(target).cuda(), copy.deepcopy(trained).cuda()
    b = step_breakdown(drafter, model, [p[None].cuda() for p in prompts], 32)
    print(format_breakdown(b))
    parts = b["parts"]
    assert b["device"] == "cuda" and b["tau"] > 1.5
    assert all(parts[p]["device_ms"] > 0 for p in PARTS)
    # the verify part is one graph replay: one launch call; the profiler gives its kernels to no
    # range (measured on an H100 at 091a5d3: verify 0 kernels, the step's total 388 against 31
    # in the parts), so only the step total holds them
    assert parts["verify"]["launches"] == pytest.approx(1.0) and parts["verify"]["kernels"] == 0
    assert b["kernels_per_step"] > sum(p["kernels"] for p in parts.values()) + 10
