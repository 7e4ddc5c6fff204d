"""drafter.kind=dspark: DSpark's slot convention, Markov head, loss, training and resume
(model/dspark.py, training/dspark_loss.py, docs/design/dspark-dflash2.md section 3)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from dflash_train import contract
from dflash_train.config import TrainConfig, validate
from dflash_train.contract import IGNORE_INDEX
from dflash_train.data.dataset import anchor_counts, build_example
from dflash_train.export.job import export_checkpoint
from dflash_train.model.dspark import DSparkConfig, DSparkDraftModel
from dflash_train.model.io import load_drafter
from dflash_train.recipe import load_command
from dflash_train.training.checkpoint import list_checkpoints
from dflash_train.training.dspark_loss import DSparkLossWeights, dspark_loss, previous_tokens
from dflash_train.training.logging import METRICS_FILE
from dflash_train.training.trainer import Trainer
from tests.cli_helpers import run_cli
from tests.conftest import SMOLLM2
from tests.train_data import CONVERSATIONS, chat_row, tiny_inputs, tiny_train_config, write_datagen_dir

DSPARK = {"kind": "dspark", "markov_rank": 16}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_inputs(tmp_path_factory.mktemp("dspark"))


def _cfg(tiny, out, **kw):
    drafter = {**DSPARK, **kw.pop("drafter", {})}
    return tiny_train_config(tiny["target"], tiny["data"], out, drafter=drafter, **kw)


# ------------------------------------------------------------------------- slot convention
def test_slot_k_is_labelled_with_the_token_k_plus_one_after_the_anchor():
    ids = torch.arange(10, 20)  # x[i] = 10 + i
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 0, 1, 1, 1])
    anchors = torch.tensor([2, 7])
    labels = contract.dspark_block_labels(ids, mask, anchors, 4)
    # anchor 2: slots 0..3 -> x[3], x[4], x[5], then x[6] has loss_mask 0
    # anchor 7: x[8], x[9], then past the row
    assert labels.tolist() == [[13, 14, 15, IGNORE_INDEX], [18, 19, IGNORE_INDEX, IGNORE_INDEX]]
    # the DFlash convention on the same blocks: slot 0 never, slot k -> x[p + k]
    assert contract.block_labels(ids, mask, anchors, 4).tolist() == [[IGNORE_INDEX, 13, 14, 15],
                                                                     [IGNORE_INDEX, 18, 19, IGNORE_INDEX]]


def test_a_hole_in_the_loss_mask_ends_the_block_and_documents_are_kept_apart():
    ids = torch.arange(10, 20)
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 1, 1, 1, 1])
    # x[2] is not trained on: slot 1 of the block at 0 is cut, and so is every later slot
    assert contract.dspark_block_labels(ids, mask, torch.tensor([0]), 4).tolist() == [[11] + [IGNORE_INDEX] * 3]
    docs = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1, 1, 1])
    assert contract.dspark_block_labels(ids, torch.ones(10, dtype=torch.long), torch.tensor([2]), 4,
                                        docs).tolist() == [[13, 14, IGNORE_INDEX, IGNORE_INDEX]]


def test_dspark_anchors_need_both_the_anchor_and_the_next_token_trained():
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 0, 1, 1, 1])
    assert contract.anchor_candidates(mask, kind="dspark").tolist() == [2, 3, 4, 7, 8]
    assert contract.anchor_candidates(mask).tolist() == [1, 2, 3, 4, 6, 7, 8]


def test_slot_weights_exp_minus_k_over_gamma_from_the_anchor_slot():
    w = contract.slot_weights(4, 2.0, "dspark")
    assert w.tolist() == pytest.approx([1.0, math.exp(-0.5), math.exp(-1.0), math.exp(-1.5)])
    # the j-th predicted token weighs the same in both kinds
    assert contract.slot_weights(5, 2.0)[1:].tolist() == pytest.approx(w.tolist())


def test_teacher_forced_previous_token_is_the_anchor_then_the_gold_tokens():
    ids = torch.arange(10, 20)
    ex = build_example(ids, torch.ones(10, dtype=torch.long), None, torch.tensor([1, 5]), block_size=3,
                       mask_token_id=0, kind="dspark")
    labels, block_ids = ex["labels"].reshape(1, -1), ex["block_ids"].reshape(1, -1)
    assert labels.tolist() == [[12, 13, 14, 16, 17, 18]]
    assert previous_tokens(labels, block_ids, 3).tolist() == [[11, 12, 13, 15, 16, 17]]


def test_the_trainer_batches_follow_the_dspark_convention(tiny, tmp_path):
    t = Trainer(_cfg(tiny, tmp_path))
    batch = t.host_batches(0)[0]
    b = t.drafter.block_size
    seen = 0
    for row in range(batch.labels.shape[0]):
        for n in range(batch.anchors.shape[1]):
            if not batch.anchor_valid[row, n]:
                continue
            p = int(batch.anchors[row, n])
            for k in range(b):
                y = int(batch.labels[row, n * b + k])
                if y != IGNORE_INDEX:
                    assert y == int(batch.input_ids[row, p + k + 1])
                    seen += k == 0
    assert seen > 0  # the anchor slot is supervised


# ----------------------------------------------------------------------------- the model
def _tiny_config(**kw) -> DSparkConfig:
    fields = dict(hidden_size=4, intermediate_size=8, num_attention_heads=1, num_key_value_heads=1, head_dim=4,
                  vocab_size=3, num_hidden_layers=1, num_target_layers=2, block_size=2, markov_rank=1,
                  dflash_config={"mask_token_id": 0, "target_layer_ids": [0]})
    fields.update(kw)
    return DSparkConfig(**fields)


def test_markov_logits_are_the_base_logits_plus_w2_w1_of_the_previous_token():
    torch.manual_seed(0)
    model = DSparkDraftModel(_tiny_config(vocab_size=5, markov_rank=2))
    base = torch.randn(5)
    w1, w2 = model.markov_head.markov_w1.weight, model.markov_head.markov_w2.weight  # (V, r), (V, r)
    assert tuple(w1.shape) == (5, 2) and tuple(w2.shape) == (5, 2)
    for prev in range(5):
        expected = base + w2 @ w1[prev]
        got = model.markov_logits(base, torch.tensor(prev))
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert model.drafts_per_block == model.block_size == 2


def _golden_case():
    """One block of 2 at anchor 0 of x = [0, 1, 2], vocabulary 3, hidden 4, rank 1, gamma 1.

    The head reads the first 3 hidden dims (logits = h[:3]); the drafter's outputs are 0, so
    the base logits are 0. W1 = [0, 1, 0]^T (only token 1 has a Markov embedding, 1), W2 =
    [0, 0, ln 2]^T; the confidence head is 0 (logit 0). The target's final states give the
    teacher [1/3, 1/3, 1/3] after position 0 and softmax([ln 2, ln 2, 0]) = [2/5, 2/5, 1/5]
    after position 1.
      slot 0: prev = x[0] = 0, bias 0, q = [1/3]*3, label x[1] = 1: CE = ln 3, L1 = 0,
              target accept 1, BCE(0, 1) = ln 2, weight 1
      slot 1: prev = x[1] = 1, bias [0, 0, ln 2], q = [1/4, 1/4, 1/2], label x[2] = 2:
              CE = ln 2, L1 = .15 + .15 + .3 = .6, accept .7, BCE(0, .7) = ln 2, weight 1/e
    """
    model = DSparkDraftModel(_tiny_config())
    with torch.no_grad():
        model.markov_head.markov_w1.weight.copy_(torch.tensor([[0.0], [1.0], [0.0]]))
        model.markov_head.markov_w2.weight.copy_(torch.tensor([[0.0], [0.0], [math.log(2)]]))
        model.confidence_head.proj.weight.zero_()
        model.confidence_head.proj.bias.zero_()
    head = nn.Linear(4, 3, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.eye(3, 4))
    head.requires_grad_(False)
    hidden = torch.zeros(1, 2, 4, requires_grad=True)
    final = torch.tensor([[[0.0, 0, 0, 0], [math.log(2), math.log(2), 0, 0], [0, 0, 0, 0]]])
    ex = build_example(torch.tensor([0, 1, 2]), torch.ones(3, dtype=torch.long), None, torch.tensor([0]),
                       block_size=2, mask_token_id=0, kind="dspark")
    weights = contract.slot_weights(2, 1.0, "dspark")
    return model, head, hidden, final, ex, weights


@pytest.mark.parametrize("chunk_size", [1, 1024])
def test_loss_terms_on_a_hand_checked_block(chunk_size):
    model, head, hidden, final, ex, weights = _golden_case()
    labels, block_ids = ex["labels"].reshape(1, -1), ex["block_ids"].reshape(1, -1)
    assert labels.tolist() == [[1, 2]]
    out = dspark_loss(model, hidden, labels, block_ids, ex["anchors"][None], final, head, weights, chunk_size,
                      DSparkLossWeights(0.1, 0.9, 1.0))
    ln2, ln3, e1 = math.log(2), math.log(3), math.exp(-1)
    slot0 = 0.1 * ln3 + 0.9 * 0.0 + ln2
    slot1 = 0.1 * ln2 + 0.9 * 0.6 + ln2
    total = float(out.weighted_sum.detach())
    assert total == pytest.approx(slot0 + e1 * slot1, abs=1e-5)  # 1.28215...
    assert total == pytest.approx(1.282152, abs=1e-5)
    assert float(out.weight_sum) == pytest.approx(1 + e1, abs=1e-6)
    # entry k + 1 is slot k: slot 0's argmax (0 of a tie) misses label 1, slot 1's hits label 2
    assert out.count.tolist() == [0.0, 1.0, 1.0] and out.correct.tolist() == [0.0, 0.0, 1.0]
    # each term alone
    terms = {}
    for name, alphas in {"ce": (1, 0, 0), "l1": (0, 1, 0), "bce": (0, 0, 1)}.items():
        terms[name] = float(dspark_loss(model, hidden, labels, block_ids, ex["anchors"][None], final, head, weights,
                                        chunk_size, DSparkLossWeights(*alphas)).weighted_sum.detach())
    assert terms["ce"] == pytest.approx(ln3 + e1 * ln2, abs=1e-5)
    assert terms["l1"] == pytest.approx(e1 * 0.6, abs=1e-5)
    assert terms["bce"] == pytest.approx((1 + e1) * ln2, abs=1e-5)


def test_loss_gradients_reach_the_backbone_output_and_both_markov_matrices():
    model, head, hidden, final, ex, weights = _golden_case()
    out = dspark_loss(model, hidden, ex["labels"].reshape(1, -1), ex["block_ids"].reshape(1, -1), ex["anchors"][None],
                      final, head, weights, 1, DSparkLossWeights())
    out.weighted_sum.backward()
    assert hidden.grad.abs().sum() > 0
    assert model.markov_head.markov_w2.weight.grad.abs().sum() > 0
    assert model.markov_head.markov_w1.weight.grad[1].abs().sum() > 0  # token 1 was a previous token
    assert model.confidence_head.proj.weight.grad is not None
    assert head.weight.grad is None  # the target's head stays frozen


# ----------------------------------------------------------------------- training, resume
def test_dspark_trains_exports_and_resumes_to_the_same_weights(tiny, tmp_path):
    straight = Trainer(_cfg(tiny, tmp_path / "straight", max_steps=3, export=True))
    export = straight.fit()
    assert isinstance(straight.drafter, DSparkDraftModel)
    Trainer(_cfg(tiny, tmp_path / "split", max_steps=2, checkpoint={"every": 1})).fit()
    assert [c.name for c in list_checkpoints(tmp_path / "split")][-1].endswith("2")
    resumed = Trainer(_cfg(tiny, tmp_path / "split", max_steps=3))
    resumed.resume()
    assert resumed.state.step == 2
    resumed.fit()
    for (name, a), b in zip(straight.drafter.state_dict().items(), resumed.drafter.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    loaded = load_drafter(export)
    assert isinstance(loaded, DSparkDraftModel)
    for name, value in straight.drafter.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value, rtol=0, atol=0, msg=name)


def test_resume_from_a_dflash_run_as_dspark_is_refused(tiny, tmp_path):
    tiny_dflash = tiny_train_config(tiny["target"], tiny["data"], tmp_path, max_steps=1)
    Trainer(tiny_dflash).fit()
    with pytest.raises(ValueError, match=r"drafter.kind: 'dflash' -> 'dspark'"):
        Trainer(_cfg(tiny, tmp_path, max_steps=2)).resume()


@pytest.mark.parametrize("override, message", [
    ({"drafter": {"kind": "medusa"}}, "drafter.kind"),
    ({"drafter": {"markov_head_type": "rnn"}}, "drafter.markov_head_type"),
    ({"drafter": {"markov_rank": 0}}, "drafter.markov_rank=0"),
    ({"loss": {"distill_weight": 0.5}}, "loss.distill_weight=0.5 with drafter.kind=dspark"),
    ({"loss": {"position_weighting": "dpace"}}, "loss.position_weighting='dpace' with drafter.kind=dspark"),
    ({"backend": {"name": "fsdp2", "device": "cpu"}}, "backend.name=fsdp2 with drafter.kind=dspark"),
])
def test_bad_dspark_settings_are_one_line_errors(tiny, tmp_path, override, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        _cfg(tiny, tmp_path, **override)


def test_dflash_eval_runs_a_trained_dspark_export_with_a_verify_of_b_plus_one_on_both_runtimes(tiny, tmp_path):
    export = Trainer(_cfg(tiny, tmp_path / "run", max_steps=2, export=True)).fit()
    args = [f"drafter_path={export}", f"target.name={tiny['target']}", "target.mask_token_id=16",
            "datasets=[mtbench]", "limit=1", "max_new_tokens=6"]
    done = run_cli("dflash-eval", *args, f"output_dir={tmp_path / 'eval'}")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert report["block_size"] == 8 and report["verify_tokens"] == 8 and report["runtime"] == "dynamic"
    result = report["datasets"]["mtbench"]
    assert result["num_prompts"] == 1 and result["tau"] >= 1.0
    # greedy: the speculative output is the target's own, prompt by prompt
    assert all(p["exact_match"] for p in result["prompts"])
    done = run_cli("dflash-eval", *args, "runtime=static", f"output_dir={tmp_path / 'eval2'}")
    assert done.returncode == 0, done.stderr[-3000:]
    static = json.loads((tmp_path / "eval2" / "results.json").read_text())
    assert static["runtime"] == "static" and static["verify_tokens"] == 8
    steps = static["datasets"]["mtbench"]["prompts"]
    assert all(p["exact_match"] for p in steps)
    # the same drafts accepted at every step as in the dynamic runtime
    assert [p["acceptance_lengths"] for p in steps] == [p["acceptance_lengths"] for p in result["prompts"]]


def test_the_quickstart_recipe_trains_a_dspark_drafter_on_smollm2(tmp_path, smollm2_tokenizer):
    """train_quickstart as shipped (SmolLM2 in bf16, bf16 autocast, the cpu_small drafter, blocks
    of 4, cached target features, held-out rows) with drafter.kind=dspark: the second epoch
    reads the features and the final hidden states from the cache, then the run resumes.
    Five conversations, three of them trained on: on a CPU without bf16 units a bf16 step of
    this loss takes seconds, and one step of the second epoch reads the cache as well as three."""
    rows = [chat_row(smollm2_tokenizer, q, a, i) for i, (q, a) in enumerate(CONVERSATIONS[:5])]
    data = write_datagen_dir(tmp_path / "data", SMOLLM2, smollm2_tokenizer, rows=rows)
    args = ["drafter.kind=dspark", "drafter.markov_rank=32", f"data.path={data}", f"output_dir={tmp_path / 'run'}",
            "data.val_rows=2", "data.val_every=3", "logging.every=1", "logging.progress_bar=false",
            "checkpoint.every=3", "export=false"]
    trainer = Trainer(load_command(TrainConfig, [*args, "max_steps=4"], "train_quickstart", "", validate))
    assert trainer.feature_cache is not None and trainer.needs_final
    trainer.fit()
    assert len(trainer.feature_cache) == 3  # every training row's features and final states, kept once
    lines = [json.loads(x) for x in (tmp_path / "run" / METRICS_FILE).read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, 5)) and all(math.isfinite(x["loss"]) for x in lines)
    assert "val_expected_tau" in lines[2] and "acc_pos_4" in lines[0] and "acc_pos_5" not in lines[0]
    # blocks of 4: DSpark drafts 4 tokens a block (its slot 0 included), so tau is at most 5
    assert 1 <= lines[2]["val_tau"] <= 5 and all(1 <= x["tau"] <= 5 for x in lines)
    resumed = Trainer(load_command(TrainConfig, [*args, "max_steps=5"], "train_quickstart", "", validate))
    resumed.resume()
    assert resumed.state.step == 4
    resumed.fit()
    assert all(torch.isfinite(p).all() for p in resumed.drafter.parameters())


def test_a_dspark_export_warm_starts_a_dspark_run_only(tiny, tmp_path):
    export = Trainer(_cfg(tiny, tmp_path / "run", max_steps=1, export=True)).fit()
    warm = Trainer(_cfg(tiny, tmp_path / "warm", drafter={"init_from": str(export)}))
    saved = load_drafter(export).state_dict()
    assert all(torch.equal(v, saved[k]) for k, v in warm.drafter.state_dict().items())
    with pytest.raises(ValueError, match=r"the checkpoint is a dspark drafter but this run builds a dflash one "
                                         r"\(drafter.kind\); set drafter.kind=dspark"):
        Trainer(tiny_train_config(tiny["target"], tiny["data"], tmp_path / "other", drafter={"init_from": str(export)}))
    with pytest.raises(ValueError, match=r"markov_rank=16 but this run builds 8 \(drafter.markov_rank\)"):
        Trainer(_cfg(tiny, tmp_path / "rank", drafter={"init_from": str(export), "markov_rank": 8}))


def test_dflash_export_of_a_dspark_checkpoint_equals_the_trainers_export(tiny, tmp_path):
    trainer = Trainer(_cfg(tiny, tmp_path / "run", max_steps=2, checkpoint={"every": 1}, export=True))
    trained = trainer.fit()
    path, _ = export_checkpoint(list_checkpoints(tmp_path / "run")[-1], tmp_path / "exported")
    assert json.loads((path / "config.json").read_text()) == json.loads((trained / "config.json").read_text())
    a, b = load_drafter(path).state_dict(), load_drafter(trained).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    card = (trained / "README.md").read_text()
    assert '"method": "dspark"' in card and '"num_speculative_tokens": 8' in card
    assert "--speculative-algorithm DSPARK" in card and "--speculative-num-draft-tokens 9" in card


def test_packing_counts_the_dspark_anchors_the_rows_will_draw():
    import datasets

    masks = [[0, 0, 1, 1, 1, 1, 0, 1, 1, 1], [1, 0, 1, 0, 1, 1], [0, 1], [1, 1, 1]]
    ds = datasets.Dataset.from_dict({"input_ids": [list(range(len(m))) for m in masks], "loss_mask": masks})
    for kind in ("dflash", "dspark"):
        for max_length in (3, 10):
            expected = [min(contract.anchor_candidates(torch.tensor(m[:max_length]), kind=kind).numel(), 4)
                        for m in masks]
            assert anchor_counts(ds, max_length, 4, rows_per_pass=3, kind=kind).tolist() == expected, (kind, max_length)
