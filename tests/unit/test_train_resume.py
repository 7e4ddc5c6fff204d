"""Trustworthy resumes: changed settings are refused (or applied for real with force),
damaged checkpoints are detected by their checksums, and broken weights are never exported
or evaluated."""

import json
import logging

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from dflash_train.model.io import load_drafter
from dflash_train.model.target import load_tokenizer
from dflash_train.training.checkpoint import (
    CHECKSUMS_FILE,
    CONFIG_FILE,
    changed_settings,
    list_checkpoints,
    write_checksums,
)
from dflash_train.training.logging import METRICS_FILE
from dflash_train.training.run_dir import mark_output_dir
from dflash_train.training.trainer import Trainer
from tests.cli_helpers import assert_one_line_error, run_cli, snapshot
from tests.conftest import SMOLLM2
from tests.train_data import save_tiny_target, tiny_train_args, tiny_train_config, write_datagen_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    tok = load_tokenizer(SMOLLM2)
    target = save_tiny_target(root / "target", tok)
    return {"root": root, "tok": tok, "target": target, "data": write_datagen_dir(root / "data", target, tok),
            "other_data": write_datagen_dir(root / "other", target, tok, repeat=2)}


def _cfg(tiny, out, **kw):
    return tiny_train_config(tiny["target"], tiny["data"], out, **kw)


def _two_checkpoints(tiny, out):
    Trainer(_cfg(tiny, out, max_steps=2, checkpoint={"every": 1})).fit()
    return list_checkpoints(out)


def test_changed_settings_lists_only_what_changes_the_computation():
    old = {"optim": {"lr": 3e-3, "micro_batch_size": 2}, "data": {"path": "a", "val_every": 0},
           "logging": {"every": 1}, "max_steps": 2, "seed": 0, "drafter": {"compile": False, "block_size": 8},
           "loss": {"gamma": 7.0, "chunk_size": 1024}}
    new = {"optim": {"lr": 1e-5, "micro_batch_size": 1}, "data": {"path": "b", "val_every": 5},
           "logging": {"every": 9}, "max_steps": 9, "seed": 0, "drafter": {"compile": True, "block_size": 16},
           "loss": {"gamma": 3.0, "chunk_size": 512}}  # the loss changes on the resuming side
    assert changed_settings(old, new) == ["data.path: 'a' -> 'b'", "drafter.block_size: 8 -> 16",
                                          "loss.gamma: 7.0 -> 3.0", "optim.lr: 0.003 -> 1e-05"]


def test_resume_with_changed_settings_is_refused_in_one_line(tiny, tmp_path):
    out = tmp_path / "run"
    Trainer(_cfg(tiny, out, max_steps=1)).fit()
    before = snapshot(out)
    done = run_cli("dflash-train", *tiny_train_args(tiny["target"], tiny["other_data"], out, "optim.lr=1e-5",
                                                    "logging.every=5", "max_steps=9"))
    line = assert_one_line_error(done, "dflash-train", "optim.lr: 0.003 -> 1e-05",
                                 f"data.path: '{tiny['data']}' -> '{tiny['other_data']}'", "checkpoint.resume=force")
    assert "logging" not in line and "max_steps" not in line
    assert snapshot(out) == before


def test_free_settings_may_change_on_resume(tiny, tmp_path):
    Trainer(_cfg(tiny, tmp_path, max_steps=1)).fit()
    t = Trainer(_cfg(tiny, tmp_path, max_steps=3, logging={"every": 2}, checkpoint={"every": 1},
                     data={"val_every": 1, "check_manifest": False}, optim={"micro_batch_size": 1,
                                                                            "grad_accum_steps": 4}))
    t.resume()
    assert t.state.step == 1


def test_force_applies_the_new_learning_rate_and_records_it(tiny, tmp_path):
    Trainer(_cfg(tiny, tmp_path / "old", max_steps=2)).fit()
    reference = Trainer(_cfg(tiny, tmp_path / "ref", max_steps=2, optim={"lr": 1e-5}))
    reference.fit()
    forced = Trainer(_cfg(tiny, tmp_path / "old", max_steps=3, optim={"lr": 1e-5}, checkpoint={"resume": "force"}))
    forced.resume()
    assert forced.state.step == 2
    # the schedule's position is the checkpoint's, its peak the new recipe's
    assert forced.backend.lr() == pytest.approx(reference.backend.lr(), rel=1e-12)
    assert forced.backend.lr() < 1e-5
    forced.fit()
    lines = [json.loads(x) for x in (tmp_path / "old" / METRICS_FILE).read_text().splitlines()]
    assert lines[-1]["step"] == 3 and lines[-1]["lr"] < 1e-5
    newest = list_checkpoints(tmp_path / "old")[-1]
    assert OmegaConf.load(newest / CONFIG_FILE).optim.lr == 1e-5


def test_force_with_another_drafter_geometry_is_a_clear_error(tiny, tmp_path):
    Trainer(_cfg(tiny, tmp_path, max_steps=1)).fit()
    t = Trainer(_cfg(tiny, tmp_path, drafter={"num_hidden_layers": 2}, checkpoint={"resume": "force"}))
    # named in settings a command-line user can change, never in torch's loading options
    with pytest.raises(ValueError, match=r"checkpoint.resume=force cannot continue .*step_00000001: the drafter changed "
                                         r"shape \(fc.weight \(64, 64\) -> \(64, 128\); drafter.num_hidden_layers: "
                                         r"1 -> 2\); resume with the checkpoint's drafter settings"):
        t.resume()
    before = snapshot(tmp_path)
    done = run_cli("dflash-train", *tiny_train_args(tiny["target"], tiny["data"], tmp_path,
                                                    "drafter.num_hidden_layers=2"))
    assert_one_line_error(done, "dflash-train", "drafter.num_hidden_layers: 1 -> 2")
    done = run_cli("dflash-train", *tiny_train_args(tiny["target"], tiny["data"], tmp_path,
                                                    "drafter.num_hidden_layers=2", "checkpoint.resume=force"))
    line = assert_one_line_error(done, "dflash-train", "checkpoint.resume=force cannot continue",
                                 "drafter.num_hidden_layers: 1 -> 2", "or pick a new output_dir")
    assert "StateDictOptions" not in line
    assert snapshot(tmp_path) == before


def test_resume_setting_accepts_true_false_force(tiny, tmp_path):
    with pytest.raises(ValueError, match="checkpoint.resume='maybe'; expected true, false or force"):
        _cfg(tiny, tmp_path, checkpoint={"resume": "maybe"})


def test_checkpoints_carry_checksums(tiny, tmp_path):
    for ckpt in _two_checkpoints(tiny, tmp_path):
        sums = json.loads((ckpt / CHECKSUMS_FILE).read_text())
        assert {"model.pt", "optimizer.pt", "scheduler.pt", "trainer_state.json", "config.yaml",
                "rng_rank0.pt"} == set(sums)


@pytest.mark.parametrize("damage", ["random_bytes", "truncated"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous(tiny, tmp_path, caplog, damage):
    first, latest = _two_checkpoints(tiny, tmp_path)
    model = latest / "model.pt"
    data = bytearray(model.read_bytes())
    if damage == "random_bytes":
        data[len(data) // 2:len(data) // 2 + 64] = torch.randint(0, 256, (64,), dtype=torch.uint8).numpy().tobytes()
        model.write_bytes(bytes(data))
    else:
        model.write_bytes(bytes(data[: len(data) // 3]))
    t = Trainer(_cfg(tiny, tmp_path, max_steps=3))
    with caplog.at_level(logging.WARNING):
        t.resume()
    assert t.state.step == 1
    assert f"checkpoint {latest} is damaged (model.pt does not match its checksum" in caplog.text
    t.fit()  # and the run goes on, rewriting the damaged step 2
    assert all(torch.isfinite(p).all() for p in t.drafter.parameters())


def _fsdp2(tiny, out, **kw) -> Trainer:
    """A Trainer on FSDP2 in this one process (its own in-memory process group)."""
    return Trainer(_cfg(tiny, out, backend={"name": "fsdp2", "device": "cpu"}, **kw))


def test_a_damaged_sharded_checkpoint_falls_back_and_another_geometry_is_refused(tiny, tmp_path, caplog):
    """FSDP2's sharded (DCP) checkpoints keep the integrity rules: a damaged shard fails its
    checksum and the previous checkpoint is used; weights of another drafter geometry are a
    clear error, not DCP's BaseException."""
    t = _fsdp2(tiny, tmp_path, max_steps=2, checkpoint={"every": 1})
    try:
        t.fit()
    finally:
        t.backend.shutdown()
    first, latest = list_checkpoints(tmp_path)
    assert "sharded/__0_0.distcp" in json.loads((first / CHECKSUMS_FILE).read_text())
    shard = latest / "sharded" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])
    t = _fsdp2(tiny, tmp_path, max_steps=3)
    try:
        with caplog.at_level(logging.WARNING):
            t.resume()
        assert t.state.step == 1
        assert f"checkpoint {latest} is damaged (sharded/__0_0.distcp does not match its checksum" in caplog.text
    finally:
        t.backend.shutdown()
    t = _fsdp2(tiny, tmp_path, drafter={"num_hidden_layers": 2}, checkpoint={"resume": "force"})
    try:
        with pytest.raises(ValueError, match=r"cannot continue .*step_00000001: the drafter changed shape "
                                             r"\(fc.weight \(64, 64\) -> \(64, 128\); drafter.num_hidden_layers"):
            t.resume()
    finally:
        t.backend.shutdown()


def test_no_good_checkpoint_is_one_clear_error(tiny, tmp_path):
    for ckpt in _two_checkpoints(tiny, tmp_path):
        (ckpt / "optimizer.pt").write_bytes(b"garbage")
    with pytest.raises(ValueError, match=r"no usable checkpoint in .*step_00000002: optimizer.pt does not match"):
        Trainer(_cfg(tiny, tmp_path, max_steps=3)).resume()
    done = run_cli("dflash-export", tmp_path, f"out={tmp_path / 'exp'}")
    assert_one_line_error(done, "dflash-export", "no usable checkpoint", "step_00000001")
    assert not (tmp_path / "exp").exists()


def _poison(ckpt):
    """NaN in one weight with checksums rewritten: the files are intact, the weights are not
    (what a diverged run leaves behind)."""
    state = torch.load(ckpt / "model.pt", weights_only=True)
    state["layers.0.mlp.up_proj.weight"][0, 0] = float("nan")
    torch.save(state, ckpt / "model.pt")
    write_checksums(ckpt)


def test_export_refuses_non_finite_weights(tiny, tmp_path):
    Trainer(_cfg(tiny, tmp_path, max_steps=1)).fit()
    _poison(list_checkpoints(tmp_path)[-1])
    done = run_cli("dflash-export", tmp_path, f"out={tmp_path / 'exp'}")
    assert_one_line_error(done, "dflash-export", "'layers.0.mlp.up_proj.weight' has non-finite values")
    assert not (tmp_path / "exp").exists()


def test_eval_refuses_non_finite_weights(tiny, tmp_path):
    Trainer(_cfg(tiny, tmp_path, max_steps=1, export=True)).fit()
    weights = tmp_path / "export" / "model.safetensors"
    state = load_file(weights)
    state["fc.weight"][0, 0] = float("inf")
    save_file(state, str(weights), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="tensor 'fc.weight' has non-finite values"):
        load_drafter(tmp_path / "export")
    done = run_cli("dflash-eval", f"drafter_path={tmp_path / 'export'}", f"target.name={tiny['target']}",
                   "target.mask_token_id=16", "datasets=[mtbench]", "limit=1", "max_new_tokens=2",
                   f"output_dir={tmp_path / 'eval'}")
    assert_one_line_error(done, "dflash-eval", "model.safetensors: tensor 'fc.weight' has non-finite values")
    assert not (tmp_path / "eval").exists()


def test_metrics_hold_one_run_only(tiny, tmp_path):
    """A fresh run (no checkpoint to resume) does not append to an earlier run's metrics, and
    a resumed run drops the lines logged after the checkpoint it resumes from."""
    out = tmp_path / "run"
    mark_output_dir(out)
    # An earlier run killed before its first checkpoint left only its marker and metrics behind.
    (out / METRICS_FILE).write_text("".join(json.dumps({"step": s, "time": 0.0, "loss": -1.0}) + "\n"
                                            for s in range(1, 6)))
    Trainer(_cfg(tiny, out, max_steps=2, checkpoint={"every": 1})).fit()
    first = [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]
    assert [m["step"] for m in first] == [1, 2] and all(m["loss"] != -1.0 for m in first)
    # As if killed after logging step 3 but before its checkpoint: resuming from step 2 logs 3 once.
    with (out / METRICS_FILE).open("a") as f:
        f.write(json.dumps({"step": 3, "time": 0.0, "loss": -1.0}) + "\n")
    Trainer(_cfg(tiny, out, max_steps=3, checkpoint={"every": 1})).fit()
    lines = [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3] and lines[-1]["loss"] != -1.0


@pytest.mark.parametrize("async_write", [False, True])
def test_each_checkpoint_write_is_logged_with_its_seconds(tiny, tmp_path, caplog, async_write):
    with caplog.at_level(logging.INFO, logger="dflash_train.training.checkpoint"):
        Trainer(_cfg(tiny, tmp_path, max_steps=2, checkpoint={"every": 1, "async_write": async_write})).fit()
    written = [r.getMessage() for r in caplog.records if r.getMessage().startswith("checkpoint ")]
    assert [w.split()[1] for w in written] == [p.name for p in list_checkpoints(tmp_path)]
    assert all(w.split(" written in ")[1].endswith(" s") and float(w.split()[-2]) >= 0 for w in written)
    # the background write also says how long training was stopped for its snapshot
    assert all((" snapshot " in w) == async_write for w in written)
