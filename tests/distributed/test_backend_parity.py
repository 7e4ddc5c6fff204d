"""Every distributed backend, 2 gloo processes, follows the loss curve of one process with
the same global batch, and its checkpoints resume at another world size.

Tolerance: float32 on CPU; the only difference is the order in which gradients of the
micro-batches and ranks are summed (about 1e-7 relative per step), which a few AdamW steps
keep far below rtol=1e-5 on the loss and 1e-4 on the weights.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from tests.distributed._backend_worker import launch, train

pytestmark = pytest.mark.distributed

BACKENDS = ["ddp", "fsdp2", "zero2", "zero3"]
ACCUM = 2  # per rank; the single-process reference accumulates 2 * ACCUM
STEPS = (3, 2, 2)  # updates run by the 2-process, 1-process and 2-process legs of the chain


def _needs(backend: str) -> None:
    if backend.startswith("zero") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")


@pytest.fixture(scope="module")
def reference() -> dict:
    return train("single", accum=2 * ACCUM, steps=sum(STEPS))


def _assert_same_curve(record: dict, reference: dict, start: int) -> None:
    end = start + len(record["loss"])
    for key in ("loss", "grad_norm", "lr"):
        torch.testing.assert_close(torch.tensor(record[key]), torch.tensor(reference[key][start:end]),
                                   rtol=1e-5, atol=1e-7, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_processes_match_one_and_resume_across_world_sizes(backend, reference, tmp_path):
    _needs(backend)
    first, second, third = STEPS
    record = launch(2, tmp_path / "a.pt", backend_name=backend, accum=ACCUM, steps=first,
                    save=tmp_path / "ckpt_2proc")
    _assert_same_curve(record, reference, 0)
    # 2 -> 1 process: the one process accumulates twice as many micro-batches
    record = launch(1, tmp_path / "b.pt", backend_name=backend, accum=2 * ACCUM, first_step=first, steps=second,
                    load=tmp_path / "ckpt_2proc", save=tmp_path / "ckpt_1proc")
    _assert_same_curve(record, reference, first)
    # 1 -> 2 processes
    record = launch(2, tmp_path / "c.pt", backend_name=backend, accum=ACCUM, first_step=first + second, steps=third,
                    load=tmp_path / "ckpt_1proc")
    _assert_same_curve(record, reference, first + second)
    torch.testing.assert_close(record["weights"], reference["weights"], rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def fsdp2_checkpoint(tmp_path_factory):
    """The sharded checkpoint 2 FSDP2 processes write after the first leg; the resumes below
    only read it."""
    root = tmp_path_factory.mktemp("fsdp2_ckpt")
    launch(2, root / "a.pt", backend_name="fsdp2", accum=ACCUM, steps=STEPS[0], save=root / "ckpt")
    return root / "ckpt"


@pytest.mark.parametrize("resume_on", ["ddp", "zero3"])
def test_sharded_fsdp2_checkpoint_resumes_under_another_backend(resume_on, reference, fsdp2_checkpoint, tmp_path):
    """FSDP2 writes DCP shards; DDP reads them back through DCP, DeepSpeed (which takes no
    DTensors) as whole tensors, each on the other world size."""
    _needs(resume_on)
    first, second, _ = STEPS
    assert (fsdp2_checkpoint / "sharded" / "__1_0.distcp").is_file()
    record = launch(1, tmp_path / "b.pt", backend_name=resume_on, accum=2 * ACCUM, first_step=first, steps=second,
                    load=fsdp2_checkpoint)
    _assert_same_curve(record, reference, first)


# DDP (which arms its all-reduce at forward time) and DeepSpeed (whose own micro-step
# counter the backend overrides) are the two that need code for this; FSDP2 reads the flag
# at backward time.
@pytest.mark.parametrize("backend", ["ddp", "zero2"])
def test_update_that_ends_before_grad_accum_steps(backend, tmp_path):
    """A short last window (sync=True after fewer than grad_accum_steps micro-steps) must
    still average gradients over ranks."""
    _needs(backend)
    accum, micro = 3, 2
    record = launch(2, tmp_path / "a.pt", backend_name=backend, accum=accum, micro=micro, steps=2)
    expected = train("single", accum=2 * accum, micro=2 * micro, steps=2)
    _assert_same_curve(record, expected, 0)
    torch.testing.assert_close(record["weights"], expected["weights"], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend", ["zero2", "zero3"])
def test_zero_gathers_the_checkpoint_onto_rank_0_only(backend, tmp_path):
    """Rank 0 keeps the full state it writes: TinyNet's 10 weights and their AdamW exp_avg,
    exp_avg_sq and step (30); rank 1 joins every gather but keeps no tensor of it."""
    _needs(backend)
    record = launch(2, tmp_path / "a.pt", held_by=backend, save=tmp_path / "ckpt")
    assert record["held"] == [{"save": 40, "export": 10}, {"save": 0, "export": 0}]


def test_fsdp2_skips_an_update_whose_gradients_are_not_finite_on_one_rank(tmp_path):
    """FSDP2's step reads the global norm of the shards once: NaN gradients on one rank make it
    NaN on both, and both skip the update (weights, moments and schedule as they were), then
    train on as one process does that never had that update."""
    record = launch(2, tmp_path / "a.pt", backend_name="fsdp2", accum=ACCUM, steps=3, poison=1)
    assert math.isnan(record["grad_norm"][1]) and not any(map(math.isnan, record["grad_norm"][::2]))
    assert record["lr"][1] == record["lr"][0]  # the schedule did not advance
    assert all(torch.isfinite(w).all() for w in record["weights"].values())
