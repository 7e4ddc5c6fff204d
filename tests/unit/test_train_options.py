"""Training options of issue 13 on tiny targets: the target's final hidden states, soft targets
at the right positions in the trainer, initialisation from target layers, the budgeted
schedule, and a short run with each option."""

import json

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from dflash_train.config import to_train_config
from dflash_train.contract import IGNORE_INDEX
from dflash_train.model.dflash import DFlashConfig, DFlashDraftModel
from dflash_train.model.init import init_from_target, source_layers
from dflash_train.model.target import TargetModel
from dflash_train.training.logging import METRICS_FILE
from dflash_train.training.trainer import Trainer
from tests.conftest import make_tiny_target
from tests.train_data import tiny_inputs, tiny_train_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_inputs(tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("ids", [[0, 2], [1, 5]])  # stops early / needs the last layer
def test_final_hidden_states_give_the_target_logits(arch, ids):
    model = make_tiny_target(arch)
    tm = TargetModel(model)
    x = torch.randint(0, 90, (2, 10))
    feats, final = tm.features_and_final(x, ids)
    assert torch.equal(feats, tm.features(x, ids))
    torch.testing.assert_close(tm.lm_head(final), model(x).logits)


def test_trainer_distils_the_target_distribution_after_the_previous_position(tiny, tmp_path):
    # The trainer's own batch, features and loss against soft targets read from the target's
    # full logits at p + k - 1 for slot k of the block at anchor p.
    t = Trainer(tiny_train_config(tiny["target"], tiny["data"], tmp_path, loss={"distill_weight": 1.0}))
    batch = t.micro_batches(0)[0]
    feats, noise, final = t.target_inputs(batch)
    hidden = t.draft(batch, feats, noise, t.masks(batch))
    out = t.loss(batch, hidden, final)
    with torch.no_grad():
        target_logits = t.target.model(batch.input_ids, attention_mask=batch.attention_mask).logits  # (b, T, V)
    z = t.target.lm_head(hidden).float()  # (b, Q, V)
    b_size = t.drafter.block_size
    ref = torch.zeros(())
    for r, q in (batch.labels != IGNORE_INDEX).nonzero().tolist():
        p, k = int(batch.anchors[r, q // b_size]), q % b_size
        soft = F.log_softmax(target_logits[r, p + k - 1].float(), -1)
        kl = F.kl_div(F.log_softmax(z[r, q], -1), soft, log_target=True, reduction="sum")
        ref = ref + t.slot_weights[k] * kl
    torch.testing.assert_close(out.weighted_sum, ref, rtol=1e-4, atol=1e-4)


# Pinned mapping: 2 draft layers over a 6-layer target start from target layers 4 and 5.
LAYER_TENSORS = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight"]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_init_from_target_copies_the_last_layers(arch):
    model = make_tiny_target(arch, layers=6)
    with torch.no_grad():  # norms start at ones in the target and in a fresh drafter alike
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    cfg = DFlashConfig.from_target(model.config, mask_token_id=5, num_hidden_layers=2, block_size=4)
    torch.manual_seed(0)
    drafter = DFlashDraftModel(cfg)
    fresh = {k: v.clone() for k, v in drafter.state_dict().items()}
    copied = init_from_target(drafter, model)
    assert source_layers(2, 6) == [4, 5]
    per_layer = LAYER_TENSORS + (["self_attn.q_norm.weight", "self_attn.k_norm.weight"] if arch == "qwen3" else [])
    expected = {f"layers.{i}.{n}": f"model.layers.{j}.{n}" for i, j in ((0, 4), (1, 5)) for n in per_layer}
    expected["norm.weight"] = "model.norm.weight"
    assert copied == expected
    target_state = model.state_dict()
    for name, value in drafter.state_dict().items():
        if name in copied:  # a copy, and one that a fresh drafter would not hold by chance
            assert torch.equal(value, target_state[copied[name]]), name
            assert not torch.equal(fresh[name], target_state[copied[name]]), name
        else:  # fc, hidden_norm, and q_norm/k_norm of targets without them
            assert torch.equal(value, fresh[name]), name


def test_init_from_target_needs_enough_target_layers():
    with pytest.raises(ValueError, match="num_hidden_layers=7 needs a target with at least as many layers"):
        source_layers(7, 6)


def _metrics(out):
    return [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]


@pytest.mark.parametrize("overrides", [
    {"loss": {"distill_weight": 0.5}},
    {"loss": {"distill_weight": 1.0, "distill_temperature": 2.0}},
    {"loss": {"position_weighting": "dpace"}},
    {"loss": {"position_weighting": "dpace", "distill_weight": 0.5}},
    {"drafter": {"init_from_target": True}},
], ids=["distill", "distill-t2", "dpace", "dpace-distill", "init"])
def test_each_option_trains_end_to_end(tiny, tmp_path, overrides):
    t = Trainer(tiny_train_config(tiny["target"], tiny["data"], tmp_path, max_steps=3, epochs=3, data={"val_rows": 2},
                                  **overrides))
    t.fit()
    lines = _metrics(tmp_path)
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor(m["loss"])) and m["loss"] > 0 for m in lines)
    assert "val_expected_tau" in lines[-1]
    assert all(torch.isfinite(p).all() for p in t.drafter.parameters())


def test_schedule_spans_the_budgeted_steps(tiny, tmp_path):
    t = Trainer(tiny_train_config(tiny["target"], tiny["data"], tmp_path, max_steps=3, epochs=50,
                                  optim={"schedule_steps": 3, "warmup_ratio": 0.0}))
    t.fit()
    lrs = [m["lr"] for m in _metrics(tmp_path)]
    assert lrs[0] == pytest.approx(3e-3 * 0.75) and lrs[-1] == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("loss.distill_weight", 1.5, r"loss.distill_weight=1.5 must be in \[0, 1\]"),
    ("loss.distill_temperature", 0.0, "loss.distill_temperature=0.0 must be positive"),
    ("loss.position_weighting", "linear", r"loss.position_weighting='linear'; expected one of \['decay', 'dpace'\]"),
    ("loss.dpace_alpha", 0.0, r"loss.dpace_alpha=0.0 must be in \(0, 1\]"),
    ("optim.schedule_steps", 0, "optim.schedule_steps=0 must be positive or null"),
    ("drafter.num_hidden_layers", 7, "drafter.init_from_target with drafter.num_hidden_layers=7"),
])
def test_bad_option_values_are_one_line_errors(key, value, message):
    base = {"target": {"name": "t", "mask_token_id": 0, "num_layers": 6}, "data": {"path": "d"}, "output_dir": "o",
            "drafter": {"init_from_target": True, "num_hidden_layers": 1}}
    cfg = OmegaConf.merge(OmegaConf.create(base), OmegaConf.from_dotlist([f"{key}={value}"]))
    with pytest.raises(ValueError, match=message):
        to_train_config(cfg)
