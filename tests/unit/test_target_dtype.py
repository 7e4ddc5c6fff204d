"""``target.dtype=auto`` means the dtype for where the target runs, not where it is loaded:
the trainer loads on the CPU and moves the model, and a GGUF converted into the cache is
float32 (a float32 target made real-data GPU training 4.4x slower: 15 against 66
conversations/s on one H100)."""

import pytest
import torch

from dflash_train.model.target import target_dtype
from dflash_train.training.trainer import Trainer
from tests.conftest import SMOLLM2
from tests.train_data import save_tiny_target, tiny_train_config, write_datagen_dir


@pytest.mark.parametrize(("dtype", "device", "expected"), [
    ("auto", "cpu", torch.float32), ("auto", "cuda", torch.bfloat16), ("auto", torch.device("cuda", 1), torch.bfloat16),
    ("float16", "cuda", torch.float16), ("bfloat16", "cpu", torch.bfloat16), (torch.float32, "cuda", torch.float32),
])
def test_target_dtype(dtype, device, expected):
    assert target_dtype(dtype, device) is expected


def test_trainer_target_dtype_follows_the_backend_device(tmp_path):
    from dflash_train.model.target import load_tokenizer

    from tests.conftest import make_tiny_target

    tok = load_tokenizer(SMOLLM2)
    data = write_datagen_dir(tmp_path / "data", save_tiny_target(tmp_path / "f32", tok), tok)
    target = str(tmp_path / "target")
    make_tiny_target("llama", vocab=len(tok)).to(torch.bfloat16).save_pretrained(target)
    tok.save_pretrained(target)
    # Saved in bfloat16: "auto" on the CPU still gives float32 (not the checkpoint's dtype) ...
    cfg = tiny_train_config(target, data, tmp_path / "a", data={"check_manifest": False})
    assert {p.dtype for p in Trainer(cfg).target.model.parameters()} == {torch.float32}
    # ... and an explicit dtype is kept.
    cfg = tiny_train_config(target, data, tmp_path / "b", target={"dtype": "bfloat16"}, data={"check_manifest": False})
    assert {p.dtype for p in Trainer(cfg).target.model.parameters()} == {torch.bfloat16}
