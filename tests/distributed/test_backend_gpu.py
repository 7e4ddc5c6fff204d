"""The backends on 2 CUDA GPUs with NCCL and bf16 mixed precision (the defaults there):
they track one GPU and resume across world sizes. bf16 compute makes the backends differ
numerically (autocast for single/DDP, bf16 parameters for FSDP2 and DeepSpeed), so the
tolerance is 2e-2 relative on the loss; the CPU tests pin the exact semantics."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.distributed._backend_worker import launch

pytestmark = [pytest.mark.gpu, pytest.mark.distributed,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]

FIRST, SECOND = 3, 2


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu_ref") / "ref.pt"
    return launch(1, out, cuda=True, backend_name="single", device="cuda", accum=4, steps=FIRST + SECOND)


@pytest.mark.parametrize("backend", ["ddp", "fsdp2", "zero2", "zero3"])
def test_bf16_on_two_gpus_tracks_one_gpu_and_resumes_on_one(backend, reference, tmp_path):
    if backend.startswith("zero") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    first = launch(2, tmp_path / "a.pt", cuda=True, backend_name=backend, device="cuda", accum=2, steps=FIRST,
                   save=tmp_path / "ckpt")
    second = launch(1, tmp_path / "b.pt", cuda=True, backend_name=backend, device="cuda", accum=4,
                    first_step=FIRST, steps=SECOND, load=tmp_path / "ckpt")
    torch.testing.assert_close(torch.tensor(first["loss"] + second["loss"]), torch.tensor(reference["loss"]),
                               rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(torch.tensor(first["lr"] + second["lr"]), torch.tensor(reference["lr"]))
