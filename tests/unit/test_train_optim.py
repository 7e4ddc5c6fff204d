"""The optimizer factory takes torch's fused AdamW kernels for CUDA parameters and plain CPU ones."""

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
