"""A tiny real run on SmolLM2: pinned first-step losses, the loss falls and expected tau rises."""

import json

import pytest

from dflash_train.training.logging import METRICS_FILE
from dflash_train.training.trainer import Trainer
from tests.conftest import SMOLLM2, SMOLLM2_MASK_ID
from tests.train_data import tiny_train_config, write_datagen_dir

# Losses of the first three optimizer steps (seed 0, float32 CPU). A change means the data
# path, the loss or the optimizer changed numerically: update only on purpose. The start is
# high because SmolLM2 ties its head to the embedding and a fresh drafter's block slots are
# close to the MASK token's embedding, so the head strongly predicts MASK itself.
GOLDEN_LOSSES = [61.1881032, 60.2946934, 21.4293365]
STEPS = 16


@pytest.mark.slow
def test_smollm2_drafter_learns(smollm2, smollm2_tokenizer, tmp_path):
    data = write_datagen_dir(tmp_path / "data", SMOLLM2, smollm2_tokenizer, repeat=2)  # 16 rows
    cfg = tiny_train_config(
        SMOLLM2, data, tmp_path / "run",
        target={"mask_token_id": SMOLLM2_MASK_ID, "num_layers": 30},
        drafter={"num_hidden_layers": 2, "target_layer_ids": [2, 6, 10]},
        data={"num_anchors": 16, "max_length": 128},
        optim={"lr": 3e-3, "warmup_ratio": 0.1},
        epochs=4,
    )
    Trainer(cfg, target=smollm2).fit()
    lines = [json.loads(line) for line in (tmp_path / "run" / METRICS_FILE).read_text().splitlines()]
    assert len(lines) == STEPS
    losses = [m["loss"] for m in lines]
    assert losses[:3] == pytest.approx(GOLDEN_LOSSES, rel=1e-3)
    first, last = lines[:4], lines[-4:]
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    assert mean(last, "loss") < 0.7 * mean(first, "loss")
    assert mean(last, "acc_pos_1") > 5 * mean(first, "acc_pos_1")
    assert mean(last, "expected_tau") > mean(first, "expected_tau") + 0.05
