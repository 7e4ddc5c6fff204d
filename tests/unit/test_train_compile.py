"""A compiled drafter and target never recompile after warm-up on rows of varied lengths,
validation included; the compiled target gives the eager target's features."""

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
    def config(compile_: bool):
        return tiny_train_config(
            target, data, tmp_path / f"run-{compile_}",
            target={"compile": compile_},
            drafter={"compile": compile_, "attention": "dense", "num_hidden_layers": 2},
            data={"packing": True, "max_length": 96, "num_anchors": 6, "blocks_per_row": 16, "val_rows": 5},
            optim={"micro_batch_size": 2, "grad_accum_steps": 1},
        )

    torch._dynamo.reset()
    trainer, eager = Trainer(config(True)), Trainer(config(False))
    batch = trainer.micro_batches(0)[0]
    assert batch.doc_ids is not None and (batch.doc_ids[0] != batch.doc_ids[0, 0]).any()  # packed rows
    before = _graphs()  # the counter is per process: other tests compiled graphs before this one
    feats, noise, _ = trainer.target_inputs(batch)
    # One graph for all six target layers: they share a code object, their weights are inputs.
    assert _graphs() - before == 1
    ref_feats, ref_noise, _ = eager.target_inputs(batch)
    torch.testing.assert_close(feats, ref_feats, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(noise, ref_noise, rtol=0, atol=0)
    lengths = {int(b.stats.tokens) for s in range(4) for b in trainer.host_batches(s)}
    assert len(lengths) > 1  # the rows really differ in length; only their padded shape is fixed
    trainer.train_step(0)
    trainer.validate()
    warm = _graphs()
    assert warm > before + 1  # the drafter's layers were compiled too
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(1, 5):
            trainer.train_step(step)
            if step % 2 == 0:
                trainer.validate()
    assert _graphs() == warm
