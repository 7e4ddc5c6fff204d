"""A compiled drafter never recompiles after warm-up on rows of varied lengths, validation included."""

import torch
from torch._dynamo.utils import counters

from dflash_train.model.target import load_tokenizer
from dflash_train.training.trainer import Trainer
from tests.conftest import SMOLLM2
from tests.train_data import save_tiny_target, tiny_train_config, write_datagen_dir


def _graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def test_fixed_shapes_compile_once_for_training_and_validation(tmp_path):
    """Dense masks: on CPU flex attention has no backward; tests/gpu covers the flex path."""
    tok = load_tokenizer(SMOLLM2)
    target = save_tiny_target(tmp_path / "target", tok)
    data = write_datagen_dir(tmp_path / "data", target, tok, repeat=3)  # 24 conversations of 27-47 tokens
    cfg = tiny_train_config(
        target, data, tmp_path / "run",
        drafter={"compile": True, "attention": "dense", "num_hidden_layers": 2},
        data={"packing": True, "max_length": 96, "num_anchors": 6, "blocks_per_row": 16, "val_rows": 5},
        optim={"micro_batch_size": 2, "grad_accum_steps": 1},
    )
    torch._dynamo.reset()
    trainer = Trainer(cfg)
    lengths = {int(b.stats.tokens) for s in range(4) for b in trainer._host_batches(s)}
    assert len(lengths) > 1  # the rows really differ in length; only their padded shape is fixed
    trainer.train_step(0)
    trainer.validate()
    warm = _graphs()
    assert warm > 0  # the layers were compiled
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(1, 5):
            trainer.train_step(step)
            if step % 2 == 0:
                trainer.validate()
    assert _graphs() == warm
