"""The optimizer factory takes torch's fused AdamW kernels for CUDA parameters and plain CPU ones."""

import math
from types import SimpleNamespace

import pytest
import torch

from dflash_train.config import OptimConfig
from dflash_train.training import optim


def test_cpu_parameters_step_with_the_fused_adamw_equal_to_the_default_within_an_ulp():
    torch.manual_seed(0)
    start = [torch.randn(64, 32), torch.randn(32)]
    grads = [[torch.randn_like(t) for t in start] for _ in range(20)]
    results = {}
    for name, build in (("ours", optim.optimizer_factory(OptimConfig(weight_decay=0.1))),
                        ("default", lambda groups: torch.optim.AdamW(groups, lr=OptimConfig().lr))):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        opt = build(optim.param_groups(params, 0.1) if name == "default" else params)
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.clone()
            opt.step()
        results[name] = (opt, params)
    opt, ours = results["ours"]
    assert opt.defaults["fused"] is True
    for mine, theirs in zip(ours, results["default"][1]):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=4e-7)
        assert not torch.equal(mine, start[0] if mine.ndim == 2 else start[1])  # it did step


class _Sharded:
    """Stands in for a DTensor parameter (FSDP2's shards)."""

    def __init__(self, device):
        self.device, self.is_cuda, self.ndim, self.requires_grad = torch.device(device), device == "cuda", 2, True


@pytest.mark.parametrize(("devices", "fused"), [(["cuda", "cuda"], True), (["cuda", "cpu"], None),
                                                 (["cpu", "cpu"], True), (["cpu-sharded", "cpu"], None),
                                                 (["cuda-sharded", "cuda"], True)])
def test_fused_on_cuda_and_for_plain_cpu_parameters(monkeypatch, devices, fused):
    # No GPU here: stand-in parameters that answer is_cuda and device, and an AdamW that records its kwargs.
    built = {}
    monkeypatch.setattr(optim.torch.optim, "AdamW", lambda groups, **kwargs: built.update(kwargs))
    monkeypatch.setattr(optim, "DTensor", _Sharded)
    params = [_Sharded(d.split("-")[0]) if d.endswith("-sharded") else
              SimpleNamespace(is_cuda=d == "cuda", device=torch.device(d), ndim=2 - i, requires_grad=True)
              for i, d in enumerate(devices)]
    optim.optimizer_factory(OptimConfig())(params)
    assert built["fused"] is fused


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_parameters_take_the_fused_adamw():
    params = [torch.nn.Parameter(torch.randn(3, 2, device="cuda")), torch.nn.Parameter(torch.randn(3, device="cuda"))]
    opt = optim.optimizer_factory(OptimConfig())(params)
    assert opt.defaults["fused"] is True
    params[0].grad, params[1].grad = torch.ones_like(params[0]), torch.ones_like(params[1])
    opt.step()



def _lrs(steps: int, **settings) -> list[float]:
    """The lr at each of ``steps`` steps of a schedule planned for ``steps``."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    schedule = optim.scheduler_factory(OptimConfig(lr=1.0, **settings), steps)(opt)
    out = []
    for _ in range(steps):
        out.append(schedule.get_last_lr()[0])
        opt.step()
        schedule.step()
    return out


def test_warmup_stable_decay_holds_the_peak_then_decays_the_last_fifth():
    lrs = _lrs(100, warmup_ratio=0.04, schedule="wsd", decay_ratio=0.2)
    assert lrs[:5] == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])  # linear warmup over 4 steps
    assert lrs[4:80] == [1.0] * 76  # the peak until the last 20 steps
    assert lrs[80:] == pytest.approx([1 - math.sqrt(k / 20) for k in range(20)])  # 1-sqrt decay
    cosine = _lrs(100, warmup_ratio=0.04)
    assert cosine[50] == pytest.approx(0.5 * (1 + math.cos(math.pi * 46 / 96)))


@pytest.mark.parametrize("settings, message", [
    (["optim.schedule=wsd", "optim.decay_ratio=0"], "optim.decay_ratio=0.0 must be in (0, 1], and with "
                                                    "optim.warmup_ratio=0.04 at most 1 for schedule=wsd"),
    (["optim.schedule=wsd", "optim.decay_ratio=0.97"], "optim.decay_ratio=0.97 must be in (0, 1], and with "
                                                       "optim.warmup_ratio=0.04 at most 1 for schedule=wsd"),
])
def test_bad_decay_ratios_are_refused(settings, message):
    from dflash_train.config import TrainConfig, validate
    from dflash_train.recipe import load_command

    with pytest.raises(ValueError) as err:
        load_command(TrainConfig, ["data.path=d", "output_dir=o", *settings], "train", "", validate)
    assert str(err.value) == message
