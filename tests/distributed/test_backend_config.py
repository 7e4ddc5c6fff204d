"""Backend config validation, the derived DeepSpeed config, and the single backend in
this process (no torch.distributed): step, clipping, skip, checkpoint round trip."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from dflash_train.config import DistributedConfig
from dflash_train.distributed import build as build_mod
from dflash_train.distributed.build import build_backend, validate_config
from dflash_train.training.state_files import STATE_FILES
from tests.distributed._backend_worker import TinyNet, micro_batch, optimizer_factory, scheduler_factory

RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "backend"


@pytest.mark.parametrize(("cfg", "message"), [
    ({"name": "zero4"}, "backend.name='zero4' is not one of ['single', 'ddp', 'fsdp2', 'zero2', 'zero3']"),
    ({"dist_backend": "mpi"}, "backend.dist_backend='mpi'"),
    ({"mixed_precision": "fp16"}, "backend.mixed_precision='fp16'"),
    ({"device": "tpu"}, "backend.device='tpu'"),
    ({"device": "cpu", "dist_backend": "nccl"}, "'nccl' needs CUDA but backend.device='cpu'"),
    ({"name": "ddp", "cpu_offload": True}, "cpu_offload needs fsdp2, zero2 or zero3, not 'ddp'"),
    ({"name": "ddp", "sharding": True}, "sharding"),
    ({"timeout_minutes": "soon"}, "soon"),
], ids=lambda v: str(v)[:40] if isinstance(v, dict) else "")
def test_bad_config_names_the_offending_value(cfg, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        build_backend(cfg)


def test_zero_without_deepspeed_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(build_mod.importlib.util, "find_spec",
                        lambda name, *a: None if name == "deepspeed" else real(name, *a))
    with pytest.raises(ValueError, match=r"backend 'zero3' needs deepspeed: pip install 'dflash-train\[deepspeed\]'"):
        build_backend({"name": "zero3"})


def test_single_refuses_a_multi_process_launch(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="backend 'single' runs one process but WORLD_SIZE=2"):
        build_backend({"name": "single"})


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.stem)
def test_backend_recipes_are_valid_configs(path):
    raw = OmegaConf.load(path)
    raw.pop("defaults", None)
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DistributedConfig), raw))
    assert cfg.name == path.stem
    if cfg.name.startswith("zero"):
        pytest.importorskip("deepspeed")
    validate_config(cfg)


def test_deepspeed_config_follows_setup_arguments():
    pytest.importorskip("deepspeed")
    from dflash_train.distributed.deepspeed import deepspeed_config

    cfg = deepspeed_config(stage=3, world_size=8, grad_accum_steps=4, clip_grad_norm=1.0, bf16=True, cpu_offload=True)
    assert cfg["zero_optimization"]["stage"] == 3
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"], cfg["train_batch_size"]) == (1, 4, 32)
    assert cfg["gradient_clipping"] == 1.0 and cfg["bf16"] == {"enabled": True}
    assert cfg["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert deepspeed_config(2, 1, 1, None, False, False)["gradient_clipping"] == 0.0


def _single(clip: float | None = 0.5, accum: int = 2):
    torch.manual_seed(0)
    backend = build_backend({"name": "single", "device": "cpu"})
    backend.setup(TinyNet(), optimizer_factory, scheduler_factory, clip, accum)
    return backend


def _accumulate(backend, step: int, accum: int = 2) -> None:
    for i in range(accum):
        x, y = micro_batch(step, i)
        backend.backward(torch.nn.functional.mse_loss(backend.model(x), y), sync=i == accum - 1)


def test_single_backend_basics():
    with pytest.raises(RuntimeError, match="setup"):
        _ = build_backend({"device": "cpu"}).model
    backend = _single(clip=0.1)
    assert (backend.rank, backend.world_size, backend.is_main, backend.mixed_dtype) == (0, 1, True, None)
    _accumulate(backend, 0)
    grads = [p.grad.clone() for p in backend.model.parameters()]
    norm = backend.step()
    assert norm == pytest.approx(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item(), rel=1e-6)
    assert norm > 0.1  # so the clip applied; the returned norm is the one before clipping
    assert backend.lr() == pytest.approx(3e-2 * 2 / 3 * 0.8)  # the worker's schedule after one step
    assert all(p.grad is None for p in backend.model.parameters())
    assert backend.all_reduce_sum(torch.tensor(3.0)).item() == 3.0


def test_skip_step_leaves_weights_optimizer_and_schedule_alone():
    backend = _single()
    _accumulate(backend, 0)
    backend.step()
    before = {k: v.clone() for k, v in backend.full_state_dict().items()}
    lr, optim_state = backend.lr(), str(backend.optimizer.state_dict())
    _accumulate(backend, 1)
    backend.skip_step()
    torch.testing.assert_close(backend.full_state_dict(), before, rtol=0, atol=0)
    assert (backend.lr(), str(backend.optimizer.state_dict())) == (lr, optim_state)
    assert all(p.grad is None for p in backend.model.parameters())


def test_single_checkpoint_round_trip(tmp_path):
    backend = _single()
    for step in range(2):
        _accumulate(backend, step)
        backend.step()
    backend.save_state(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(STATE_FILES.values())
    _accumulate(backend, 2)
    expected = backend.step(), backend.full_state_dict()

    resumed = _single()
    resumed.load_state(tmp_path)
    _accumulate(resumed, 2)
    assert resumed.step() == expected[0]
    torch.testing.assert_close(resumed.full_state_dict(), expected[1], rtol=0, atol=0)
    with pytest.raises(ValueError, match="lacks"):
        resumed.load_state(tmp_path / "missing")
