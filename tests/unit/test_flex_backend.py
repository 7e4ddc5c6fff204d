"""drafter.flex_backend: the trainer hands its choice of flex kernels to every drafter layer,
and each layer's attention passes it to flex_attention. (That the FLASH kernels compute the
DFlash mask exactly is a GPU test: tests/gpu/test_train_gpu.py.)"""

import pytest
import torch

from dflash_train.model.dflash import DFlashConfig, DFlashDraftModel
from dflash_train.model.masks import build_training_masks
from dflash_train.training.trainer import Trainer
from tests.conftest import make_tiny_target, pretend_flash_attention
from tests.train_data import tiny_inputs, tiny_train_config

FLASH = {"BACKEND": "FLASH"}


@pytest.fixture
def flash_installed(monkeypatch):
    pretend_flash_attention(monkeypatch)  # it is not, on CPU


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_inputs(tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize("backend, options", [("triton", None), ("flash", FLASH)])
def test_the_trainer_gives_every_drafter_layer_the_chosen_flex_kernels(tiny, tmp_path, flash_installed, backend,
                                                                       options):
    cfg = tiny_train_config(tiny["target"], tiny["data"], tmp_path / "run",
                            drafter={"num_hidden_layers": 2, "attention": "flex", "compile": True,
                                     "flex_backend": backend})
    trainer = Trainer(cfg)
    assert [layer.self_attn.flex_kernel_options for layer in trainer.drafter.layers] == [options, options]


def test_each_layer_passes_its_kernel_options_to_flex_attention(monkeypatch):
    import torch.nn.attention.flex_attention as fa

    target = make_tiny_target("qwen3")
    cfg = DFlashConfig.from_target(target.config, mask_token_id=96, num_hidden_layers=2, block_size=4)
    drafter = DFlashDraftModel(cfg).eval()
    drafter.layers[1].self_attn.flex_kernel_options = FLASH
    seen, real = [], fa.flex_attention

    def recording(*args, kernel_options=None, **kwargs):
        seen.append(kernel_options)
        return real(*args, **kwargs)  # the eager CPU kernel: options are for the compiled ones

    monkeypatch.setattr(fa, "flex_attention", recording)
    anchors = torch.tensor([[3, 9, 14]])
    masks = build_training_masks(cfg, anchors, torch.ones_like(anchors, dtype=torch.bool), 20)
    h = cfg.hidden_size
    with torch.no_grad():
        out = drafter(torch.randn(1, 12, h), torch.randn(1, 20, h * len(drafter.target_layer_ids)),
                      torch.cat([torch.arange(20), (anchors[0, :, None] + torch.arange(4)).flatten()])[None], masks)
    assert seen == [None, FLASH]
    assert out.shape == (1, 12, h) and torch.isfinite(out).all()
