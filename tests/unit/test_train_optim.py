"""The optimizer factory takes torch's fused AdamW kernel for CUDA parameters only."""

from types import SimpleNamespace

import pytest
import torch

from dflash_train.config import OptimConfig
from dflash_train.training import optim


def test_cpu_parameters_keep_torchs_default_adamw():
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(3))]
    opt = optim.optimizer_factory(OptimConfig())(params)
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.defaults["fused"] is None and opt.defaults["foreach"] is None


@pytest.mark.parametrize(("devices", "fused"), [(["cuda", "cuda"], True), (["cuda", "cpu"], None),
                                                 (["cpu", "cpu"], None)])
def test_fused_only_when_every_parameter_is_on_cuda(monkeypatch, devices, fused):
    # No GPU here: stand-in parameters that answer is_cuda, and an AdamW that records its kwargs.
    built = {}
    monkeypatch.setattr(optim.torch.optim, "AdamW", lambda groups, **kwargs: built.update(kwargs))
    params = [SimpleNamespace(is_cuda=d == "cuda", ndim=2 - i, requires_grad=True) for i, d in enumerate(devices)]
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
