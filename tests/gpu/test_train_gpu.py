"""GPU: the paper's geometry trains in bf16 on one GPU (Qwen3-8B-shaped random target)."""

import math

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_qwen3_8b_geometry_trains_on_one_gpu_without_oom():
    from dflash_train import bench

    result = bench.main(["+experiment=qwen3_8b_8xh100", "backend=single", "optim.grad_accum_steps=1",
                         "--random-target", "--steps", "3", "--warmup", "2"])
    assert result["seq_len"] == 3072 and result["queries_per_row"] == 512 * 16
    total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    assert result["peak_memory_gib"] < 0.9 * total_gib
    assert math.isfinite(result["samples_per_s"]) and result["samples_per_s"] > 0
    # the mask is built from the problem's structure: a small share of the step
    assert result["phase_ms"]["mask_build"] < 0.02 * sum(result["phase_ms"].values())


def _random_conversations(out_dir, vocab: int, count: int = 24):
    """A datagen folder of random conversations of 20-90 tokens (no tokenizer needed: the GPU
    image lacks the embedded SmolLM2 package)."""
    from dflash_train.data import format as data_format

    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(count):
        n, p = int(torch.randint(20, 90, (1,), generator=g)), int(torch.randint(4, 12, (1,), generator=g))
        rows.append({"input_ids": torch.randint(0, vocab, (n,), generator=g).tolist(),
                     "loss_mask": [0] * p + [1] * (n - p), "prompt_id": f"p{i}", "source": "test",
                     "finish_reason": "stop", "prompt_len": p, "response_len": n - p, "num_tokens": n})
    data_format.write_shard(out_dir, 0, rows, {})
    data_format.consolidate(out_dir, 1, {"format_version": data_format.FORMAT_VERSION, "counts": {"rows": count}})
    return out_dir


def test_packed_flex_rows_compile_once_on_gpu(tmp_path):
    """The GPU path of the CPU no-recompilation test: flex attention compiled, with backward."""
    from torch._dynamo.utils import counters

    from dflash_train.training.trainer import Trainer
    from tests.conftest import make_tiny_target
    from tests.train_data import tiny_train_config

    make_tiny_target("llama", vocab=97).save_pretrained(tmp_path / "target")
    data = _random_conversations(tmp_path / "data", vocab=97)
    cfg = tiny_train_config(
        str(tmp_path / "target"), data, tmp_path / "run",
        target={"mask_token_id": 96, "num_layers": 6},
        drafter={"compile": True, "attention": "flex", "num_hidden_layers": 2},
        data={"packing": True, "max_length": 256, "num_anchors": 6, "blocks_per_row": 24, "val_rows": 5,
              "check_manifest": False},
        optim={"micro_batch_size": 2, "grad_accum_steps": 1},
        backend={"name": "single", "device": "cuda"},
    )
    torch._dynamo.reset()
    trainer = Trainer(cfg)
    # The target is loaded on the CPU and moved: dtype=auto must still mean bfloat16 on the GPU.
    assert {p.dtype for p in trainer.target.model.parameters()} == {torch.bfloat16}
    trainer.train_step(0)
    trainer.validate()
    warm = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(1, 5):
            assert trainer.train_step(step)["finite"]
        trainer.validate()
    assert counters["stats"]["unique_graphs"] == warm
