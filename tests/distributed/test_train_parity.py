"""The real trainer on 2 gloo processes (DDP, FSDP2, ZeRO-2, ZeRO-3) follows the loss curve
of one process with the same global batch, and one process resumes its checkpoint.

Global batch 4 rows: one process accumulates 4 micro-batches of 1 row, each of the two
processes 2. Tolerance: float32 on CPU, where only the summation order of gradients over
micro-batches and ranks differs; measured differences are about 1e-7 relative, the
bounds below leave room for the drift a few AdamW steps add.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_train.training.checkpoint import CHECKSUMS_FILE, list_checkpoints
from tests.distributed._backend_worker import launch
from tests.distributed._train_worker import run

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("_train_worker.py")
FIRST, TOTAL = 2, 4  # the 2-process run stops (and checkpoints) after FIRST steps
COMPARED = ("loss", "grad_norm", "lr", "tau")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.train_data import tiny_inputs

    inputs = tiny_inputs(tmp_path_factory.mktemp("tiny_parity"))
    root, target, data = inputs["root"], inputs["target"], inputs["data"]
    reference = run(target, str(data), root / "reference", "single", micro_batch_size=1, grad_accum_steps=4,
                    max_steps=TOTAL)
    return {"target": target, "data": str(data), "reference": reference}


@pytest.fixture(scope="module")
def validation_reference(tiny, tmp_path_factory):
    """One process, 3 held-out rows: what the sharded backends' validation must reduce to."""
    return run(tiny["target"], tiny["data"], tmp_path_factory.mktemp("val_one"), "single", micro_batch_size=1,
               grad_accum_steps=4, max_steps=2, val_rows=3)


@pytest.fixture(scope="module")
def dflash2_reference(tiny, tmp_path_factory):
    """One process training a DFlash2 drafter: the curve every backend's 2 processes follow."""
    return run(tiny["target"], tiny["data"], tmp_path_factory.mktemp("dflash2_one"), "single", micro_batch_size=1,
               grad_accum_steps=4, max_steps=FIRST, kind="dflash2")


def _assert_same_steps(got: list[dict], want: list[dict]) -> None:
    assert [m["step"] for m in got] == [m["step"] for m in want]
    for key in COMPARED:
        torch.testing.assert_close(torch.tensor([m[key] for m in got], dtype=torch.float64),
                                   torch.tensor([m[key] for m in want], dtype=torch.float64),
                                   rtol=1e-5, atol=1e-7, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("backend", ["ddp", "fsdp2", "zero2", "zero3"])
def test_trainer_on_two_processes_matches_one_and_resumes_on_one(backend, tiny, tmp_path):
    if backend.startswith("zero") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    want = tiny["reference"]["metrics"]
    two = launch(2, tmp_path / "two.pt", script=WORKER, target=tiny["target"], data=tiny["data"],
                 output_dir=tmp_path / "run", backend=backend, micro_batch_size=1, grad_accum_steps=2,
                 max_steps=FIRST)
    _assert_same_steps(two["metrics"], want[:FIRST])
    # the same output_dir: one process on the single backend resumes the 2-process checkpoint
    one = run(tiny["target"], tiny["data"], tmp_path / "run", "single", micro_batch_size=1, grad_accum_steps=4,
              max_steps=TOTAL)
    _assert_same_steps(one["metrics"][FIRST:], want[FIRST:])
    torch.testing.assert_close(one["weights"], tiny["reference"]["weights"], rtol=1e-4, atol=1e-6)


def test_fsdp2_checkpoint_is_sharded_and_resumes_on_one_fsdp2_process(tiny, tmp_path):
    """Each of the 2 processes writes its own shards (DCP), nothing gathered; one FSDP2
    process reshards them on load and goes on like the uninterrupted run, and dflash-export
    turns the sharded checkpoint into the weights the run itself gathered."""
    from dflash_train.export.job import export_checkpoint

    want = tiny["reference"]["metrics"]
    two = launch(2, tmp_path / "two.pt", script=WORKER, target=tiny["target"], data=tiny["data"],
                 output_dir=tmp_path / "run", backend="fsdp2", micro_batch_size=1, grad_accum_steps=2,
                 max_steps=FIRST)
    ckpt = list_checkpoints(tmp_path / "run")[-1]
    shards = ["sharded/.metadata", "sharded/__0_0.distcp", "sharded/__1_0.distcp"]
    assert sorted(p.relative_to(ckpt).as_posix() for p in (ckpt / "sharded").iterdir()) == shards
    assert not (ckpt / "model.pt").exists() and not (ckpt / "optimizer.pt").exists()
    assert set(shards) < set(json.loads((ckpt / CHECKSUMS_FILE).read_text()))
    exported = load_file(export_checkpoint(ckpt, tmp_path / "export")[0] / "model.safetensors")
    torch.testing.assert_close(exported, two["weights"], rtol=0, atol=0)

    one = launch(1, tmp_path / "one.pt", script=WORKER, target=tiny["target"], data=tiny["data"],
                 output_dir=tmp_path / "run", backend="fsdp2", micro_batch_size=1, grad_accum_steps=4,
                 max_steps=TOTAL)
    _assert_same_steps(one["metrics"][FIRST:], want[FIRST:])
    torch.testing.assert_close(one["weights"], tiny["reference"]["weights"], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend", ["fsdp2", "zero3"])
def test_validation_on_two_sharded_processes_matches_one(backend, tiny, validation_reference, tmp_path):
    """3 held-out rows over 2 ranks: rank 1 runs a padding forward so the sharded model's
    collectives stay matched, and the reduced numbers equal one process's."""
    if backend.startswith("zero") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    one = validation_reference
    two = launch(2, tmp_path / "two.pt", script=WORKER, target=tiny["target"], data=tiny["data"],
                 output_dir=tmp_path / "run", backend=backend, micro_batch_size=1, grad_accum_steps=2,
                 max_steps=2, val_rows=3)
    want, got = one["metrics"][-1], two["metrics"][-1]
    assert "val_loss" in want and "val_loss" not in one["metrics"][0]
    for key in ("val_loss", "val_expected_tau", "val_tau", "val_acc_pos_1"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("backend", ["ddp", "fsdp2", "zero2", "zero3"])
def test_dflash2_on_two_processes_matches_one(backend, tiny, dflash2_reference, tmp_path):
    # The selector's loss calls the drafter's candidate_selector after the wrapped forward:
    # the sharding backends gather it through its own wrapping (modules_called_outside_forward).
    if backend.startswith("zero") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    want = dflash2_reference["metrics"]
    two = launch(2, tmp_path / "two.pt", script=WORKER, target=tiny["target"], data=tiny["data"],
                 output_dir=tmp_path / "run", backend=backend, micro_batch_size=1, grad_accum_steps=2,
                 max_steps=FIRST, kind="dflash2")
    _assert_same_steps(two["metrics"], want)
