"""The throughput benchmark on a dataset's own rows (CPU, tiny target): what it counts and reports."""

import json

import pytest

from dflash_train import bench
from dflash_train.data.dataset import TrainingData
from dflash_train.data.format import load_generated
from dflash_train.errors import RunError
from dflash_train.model.target import load_tokenizer
from dflash_train.training.trainer import Trainer, split_validation
from tests.conftest import SMOLLM2
from tests.train_data import save_tiny_target, write_datagen_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    tok = load_tokenizer(SMOLLM2)
    target = save_tiny_target(root / "target", tok)
    return target, write_datagen_dir(root / "data", target, tok, repeat=3)  # 24 conversations


def test_real_rows_packed_in_fixed_shapes_with_validation(tiny, tmp_path):
    target, data = tiny
    out = tmp_path / "bench.json"
    # The benchmark's own keys before and after the recipe's, in any order.
    result = bench.main(["bench.steps=2", f"target.name={target}", "target.mask_token_id=16", "target.num_layers=6",
                         f"bench.json={out}", "drafter=cpu_small", "drafter.target_layer_ids=[1,3]",
                         f"data.path={data}", "data.packing=true", "data.max_length=176", "data.num_anchors=8",
                         "data.blocks_per_row=24", "data.val_rows=4", "optim.micro_batch_size=2", "bench.warmup=1"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["fixed_shape"] == [176, 24] and result["queries_per_row"] == 24 * 8
    # Several conversations per row: conversations/s exceeds rows/s by the packing factor.
    assert result["conversations_per_row"] >= 2
    assert result["samples_per_s"] == pytest.approx(result["rows_per_s"] * result["conversations_per_row"])
    # At the data set's mean: the 20 training conversations (4 held out) over all the packed
    # rows of the training split, built here as the trainer builds them: 7 rows of 3 or 2
    # conversations, a mean no 4 timed rows can have; at the measured row rate an epoch of
    # them takes rows / rows_per_s.
    train_rows, _ = split_validation(24, 4, seed=0)
    packed = TrainingData(load_generated(data), indices=train_rows, max_length=176, packing=True, seed=0, shuffle=True,
                          num_anchors=8, block_size=8, mask_token_id=16, blocks_per_row=24)
    assert len(packed) == 7 and result["data_conversations_per_row"] == pytest.approx(20 / 7)
    epoch_s = len(packed) / result["rows_per_s"]
    assert result["samples_per_s_at_data_mean"] == pytest.approx(20 / epoch_s)
    assert 0 < result["token_fill"] <= 1 and 0 < result["block_fill"] <= 1
    assert 0 < result["supervised_tokens_per_s"] < result["tokens_per_s"]
    assert result["validation_rows"] >= 1 and result["validation_s"] > 0
    assert result["samples_per_s_with_validation"] <= result["samples_per_s"]
    assert result["graphs_compiled_after_warmup"] == 0


def test_random_rows_stay_full_length(tiny, tmp_path):
    target, _ = tiny
    result = bench.main([f"target.name={target}", "target.mask_token_id=16", "target.num_layers=6",
                         "drafter=cpu_small", "drafter.target_layer_ids=[1,3]", "data.max_length=64",
                         "data.num_anchors=4", "bench.steps=1", "bench.warmup=1", f"bench.profile={tmp_path / 'p.txt'}"])
    # bench.profile: torch's operator table of one more step (CPU time here), the optimizer's included
    table = (tmp_path / "p.txt").read_text()
    assert "Self CPU" in table and "aten::mm" in table and "Optimizer.step" in table
    assert result["fixed_shape"] is None and result["conversations_per_row"] == 1
    assert result["data_conversations_per_row"] == 1
    assert result["tokens_per_s"] == pytest.approx(64 * result["rows_per_s"], rel=1e-6)


def test_a_dflash2_drafter_is_benchmarked_with_its_own_loss(tiny):
    target, data = tiny
    args = [f"target.name={target}", "target.mask_token_id=16", "target.num_layers=6", "drafter=cpu_small",
            "drafter.target_layer_ids=[1,3]", f"data.path={data}", "data.max_length=64", "data.num_anchors=4",
            "bench.steps=1", "bench.warmup=1"]
    plain = bench.main(args)
    two = bench.main([*args, "drafter.kind=dflash2", "drafter.dflash2.selector_rank=8"])
    assert (plain["drafter_kind"], two["drafter_kind"]) == ("dflash", "dflash2")
    # the selector's two V x 8 codebooks, its 64 -> 8 projection and 4 convolutions of 2 x 2 x 64 + 16 x 64
    extra = (2 * 49152 * 8 + 8 * 64 + 2 * 2 * (2 * 2 * 64 + 16 * 64)) / 1e6
    assert two["drafter_params_m"] == pytest.approx(plain["drafter_params_m"] + extra)
    assert two["step_s"] > 0


def test_steps_that_skip_their_update_are_not_timed(tiny):
    """A step with a non-finite loss skips the optimizer's pass, so it is faster than a real
    one: a kernel option or learning rate that makes every step NaN must not pass for speed."""
    target, _ = tiny
    args = [f"target.name={target}", "target.mask_token_id=16", "target.num_layers=6", "drafter=cpu_small",
            "drafter.target_layer_ids=[1,3]", "data.max_length=64", "data.num_anchors=4", "bench.steps=2",
            "bench.warmup=1", "optim.warmup_ratio=0"]
    # The warm-up step moves every weight by about the learning rate: 1e30 overflows the next forward.
    with pytest.raises(RunError, match="2 of the 2 timed steps had a non-finite loss or gradient norm"):
        bench.main([*args, "optim.lr=1e30"])
    # (A run with finite steps still reports: the other tests here.)


@pytest.mark.parametrize("key", ["json", "profile"])
def test_a_users_file_is_not_overwritten(tiny, tmp_path, capsys, key):
    target, data = tiny
    mine = tmp_path / "notes.txt"
    mine.write_text("my notes\n")
    with pytest.raises(ValueError, match=rf"bench.{key}={mine} exists and is not an earlier dflash-bench "
                                         rf"{key}: it is left untouched; name a new file"):
        bench.main([f"target.name={target}", f"data.path={data}", "target.num_layers=6", "target.mask_token_id=16",
                    "drafter=cpu_small", "drafter.target_layer_ids=[1,3]", f"bench.{key}={mine}"])
    assert mine.read_text() == "my notes\n"
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"samples_per_s": 1.0}))
    assert bench._is_result(earlier) and not bench._is_result(mine)
    profile = tmp_path / "profile.txt"
    profile.write_text(bench.PROFILE_HEADER + "kernels\n")
    assert bench._is_profile(profile) and not bench._is_profile(mine)


def test_flex_attention_on_the_cpu_is_refused_before_any_step(tiny, monkeypatch):
    # The trainer's own refusal (Trainer.check_can_train), not flex attention's traceback
    # from the first backward.
    target, data = tiny
    monkeypatch.setattr(Trainer, "train_step", lambda *a: pytest.fail("a step ran"))
    with pytest.raises(ValueError, match=r"^drafter.attention=flex cannot train on the CPU .*add drafter.attention=dense$"):
        bench.main([f"target.name={target}", f"data.path={data}", "target.num_layers=6", "target.mask_token_id=16",
                    "drafter=cpu_small", "drafter.target_layer_ids=[1,3]", "drafter.attention=flex"])


def test_the_benchmark_times_a_dspark_drafter(tiny, tmp_path):
    """drafter.kind=dspark: the same step (its loss runs the target to its head and the Markov
    head), on real rows and on random ones; the result names the kind."""
    target, data = tiny
    common = ["bench.steps=1", "bench.warmup=1", f"target.name={target}", "target.mask_token_id=16",
              "target.num_layers=6", "drafter=cpu_small", "drafter.target_layer_ids=[1,3]", "data.max_length=96",
              "data.num_anchors=4"]
    dspark = [*common, "drafter.kind=dspark", "drafter.markov_rank=16"]
    real = bench.main([*dspark, f"data.path={data}", f"bench.json={tmp_path / 'real.json'}"])
    rows = bench.main([*dspark, f"bench.json={tmp_path / 'random.json'}"])
    dflash = bench.main([*common, f"bench.json={tmp_path / 'dflash.json'}"])
    for r in (real, rows):
        assert r["drafter_kind"] == "dspark" and r["step_s"] > 0 and r["phase_ms"]["loss"] > 0
        assert r["supervised_tokens_per_s"] > 0
    assert dflash["drafter_kind"] == "dflash"
    vocab = len(load_tokenizer(SMOLLM2))
    # the Markov head's W1 and W2 (V x r each) and the confidence head (H + r inputs, a bias)
    extra = (2 * vocab * 16 + 64 + 16 + 1) / 1e6
    assert rows["drafter_params_m"] - dflash["drafter_params_m"] == pytest.approx(extra, abs=1e-9)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_random_target_keeps_the_buffers_its_model_computes(arch):
    """bench.random_target=true draws the parameters on the device, but the buffers (rotary
    frequencies) are the model's own: to_empty leaves them uninitialised, and a target with
    such frequencies gave the paper geometry NaN losses now and then (ZeRO-3 on one CPU process)."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflash_train.training.throughput import random_target
    from tests.conftest import make_tiny_target

    config = make_tiny_target(arch).config
    want = dict(AutoModelForCausalLM.from_config(config).named_buffers())
    got = dict(random_target(config, torch.device("cpu"), torch.float32).model.named_buffers())
    assert sorted(got) == sorted(want) and "model.rotary_emb.inv_freq" in got
    for name, buffer in got.items():
        assert torch.equal(buffer, want[name]), name
