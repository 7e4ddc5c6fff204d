"""benchmarks/modelopt_quality.py's own parts, without Model-Optimizer: dflash-quality's settings
and its own, the overrides our recipe and dflash-eval get, the rows as Model-Optimizer's collator
hands them over, its DFlash settings with our geometry, the schedule's end, and the table."""

import json
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config

from benchmarks import modelopt_quality as mo  # imports no Model-Optimizer until it trains
from dflash_train import quality

HELD_OUT = "benchmarks/quality-h100-2026-11-24/sharegpt-heldout.jsonl"
# The side-by-side run's settings, as benchmarks/modelopt-side-by-side/run.sh gives them to both trainers.
GPU_RUN = ["target=qwen25_coder_05b", "target.name=/tmp/qwen25coder05b.gguf",
           "data.path=/tmp/data/sharegpt-qwen25-coder-05b", "budget_min=5", "run_dir=/tmp/mo-5",
           'train=["+experiment=qwen25_coder_05b_1xh100","logging.wandb=disabled"]', 'eval=["batch_size=120"]',
           f"datasets=[mtbench,humaneval,{HELD_OUT}]"]


def test_it_takes_dflash_qualitys_settings_and_its_own():
    run, options = mo.load(GPU_RUN)
    assert (run.target_recipe, run.target_overrides, run.data_path) == (
        "qwen25_coder_05b", ["target.name=/tmp/qwen25coder05b.gguf"], "/tmp/data/sharegpt-qwen25-coder-05b")
    cfg = run.cfg
    assert (cfg.budget_min, cfg.run_dir, cfg.data.val_rows, cfg.limit, cfg.max_new_tokens) == (5.0, "/tmp/mo-5", 64, 40, 256)
    assert (cfg.train, cfg.eval) == (["+experiment=qwen25_coder_05b_1xh100", "logging.wandb=disabled"], ["batch_size=120"])
    assert (cfg.probe_steps, cfg.warmup_steps, options.seq_len) == (8, 3, 4096)
    _, options = mo.load([*GPU_RUN, "modelopt.seq_len=3072", "probe_steps=20"])
    assert options.seq_len == 3072
    assert mo.settings(*mo.load(GPU_RUN))["modelopt.seq_len"] == 4096


def test_the_overrides_our_recipe_and_dflash_eval_get():
    run, _ = mo.load(GPU_RUN)
    assert mo.our_overrides(run, ["drafter.attention=dense"], Path("/tmp/mo-5/heldout")) == [
        "target=qwen25_coder_05b", "data.path=/tmp/data/sharegpt-qwen25-coder-05b", "drafter.attention=dense",
        "target.name=/tmp/qwen25coder05b.gguf", "+experiment=qwen25_coder_05b_1xh100", "logging.wandb=disabled",
        "output_dir=/tmp/mo-5/heldout", "data.val_rows=64", "logging.wandb=disabled", "logging.progress_bar=false",
        "export=false", "checkpoint.every=0", "checkpoint.resume=false"]
    held_out = mo.our_overrides(run, [], Path("h"), init_from=Path("/tmp/mo-5/export"))
    assert held_out[-2:] == ["drafter.init_from=/tmp/mo-5/export", "drafter.init_from_target=false"]
    # dflash-eval gets the command dflash-quality's eval stage runs.
    assert quality.eval_command(run, Path("/tmp/mo-5/export"), Path("/tmp/mo-5/eval"), "cuda")[3:] == [
        "target=qwen25_coder_05b", "target.name=/tmp/qwen25coder05b.gguf", "drafter_path=/tmp/mo-5/export",
        "output_dir=/tmp/mo-5/eval", f"datasets=[mtbench,humaneval,{HELD_OUT}]", "limit=40", "max_new_tokens=256",
        "device=cuda", "batch_size=120"]


def qwen25_coder_05b_config() -> Qwen2Config:
    """Qwen2.5-Coder-0.5B-Instruct's shape (its config.json)."""
    return Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1e6,
                       vocab_size=151936)


def test_model_optimizers_drafter_gets_our_geometry():
    run, _ = mo.load(GPU_RUN)
    cfg = mo.our_config(mo.our_overrides(run, [], Path("out")))
    settings = mo.dflash_settings(cfg, qwen25_coder_05b_config())
    arch = settings.pop("dflash_architecture_config")
    assert arch == {"num_hidden_layers": 5, "target_layer_ids": [1, 6, 11, 16, 21], "hidden_size": 896,
                    "intermediate_size": 4864, "num_attention_heads": 14, "num_key_value_heads": 2, "head_dim": 64,
                    "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "rope_theta": 1e6}
    assert settings == {"dflash_block_size": 16, "dflash_num_anchors": 512, "dflash_loss_objective": "dpace",
                        "dflash_dpace_alpha": 0.5, "dflash_self_logit_distillation": True,
                        "dflash_loss_decay_factor": 4.0, "dflash_freeze_base_model": True,
                        "dflash_use_torch_compile": False, "dflash_draft_attention": "bidirectional",
                        "dflash_mask_token_id": 151665}
    assert mo.padded_length(4096, cfg.drafter.block_size) == 4096 and mo.padded_length(300, 16) == 304
    # Model-Optimizer fuses one target layer per draft layer: a recipe with more features is refused.
    run, _ = mo.load([*GPU_RUN, 'train=["drafter=cpu_small"]'])
    small = mo.our_config(mo.our_overrides(run, [], Path("out")))
    with pytest.raises(ValueError, match=r"^Model-Optimizer needs one target layer per draft layer; the recipe has 3 "
                                         r"features \(\[2, 6, 10\]\) for drafter.num_hidden_layers=2$"):
        mo.dflash_settings(small, qwen25_coder_05b_config())


def test_a_row_as_model_optimizers_collator_hands_it_over():
    row = {"input_ids": [5, 6, 7, 8, 9, 10], "loss_mask": [0, 0, 1, 1, 1, 1]}
    batch = mo.modelopt_batch(row, max_length=5, seq_len=8, pad_id=0, device="cpu")
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]]  # cut at data.max_length, padded right
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0, 0]]
    assert batch["labels"].tolist() == [[-100, -100, 7, 8, 9, -100, -100, -100]]  # the loss mask's tokens only
    short = mo.modelopt_batch(row, max_length=3072, seq_len=4, pad_id=0, device="cpu")
    assert short["input_ids"].tolist() == [[5, 6, 7, 8]] and short["labels"].tolist() == [[-100, -100, 7, 8]]


def test_the_schedule_ends_with_the_budget():
    schedule = mo.BudgetSchedule(warmup=100)
    assert [schedule(s) for s in (0, 50, 100, 500)] == [0.0, 0.5, 1.0, 1.0]  # no end known yet
    # Step 20 of a 300 s budget, 60 s gone, 0.5 s a step: 480 steps more.
    schedule.total = mo.last_step(20, 300.0, 60.0, 0.5)
    assert schedule.total == 500
    assert [schedule(s) for s in (50, 100, 300, 500, 600)] == [0.5, 1.0, 0.5, 0.0, 0.0]
    assert mo.last_step(20, 300.0, 299.9, 0.5) == 21  # never fewer steps than the one being run


def test_the_schedule_end_is_refitted_up_to_its_middle():
    # probe at step 8: refits at 108, 208, ... while the step is at most half the planned end
    assert [s for s in range(1, 1500) if mo.refit_due(s, 8, 1000)] == [108, 208, 308, 408]
    assert not mo.refit_due(108, 8, None)  # nothing planned yet
    assert not mo.refit_due(8, 8, 1000)  # the probe itself fixes the first end


def test_the_table_has_dflash_qualitys_columns():
    trained = {"train_minutes": 5.04, "steps": 1200, "conversations": 1200}
    evals = {"mtbench": {"tau": 1.81, "num_prompts": 40}, "humaneval": {"tau": 1.9, "num_prompts": 40},
             "sharegpt-heldout": {"tau": 1.75, "num_prompts": 40}}
    s = mo.summary(trained, 1.666, evals, 90.0, 1.8)
    assert quality.table(s) == (
        "| training min | steps | conversations | held-out expected tau | held-out tau (blocks) | tau mtbench (40) "
        "| tau humaneval (40) | tau sharegpt-heldout (40) | eval min |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
        "| 5.0 | 1200 | 1200 | 1.67 | 1.80 | 1.81 | 1.90 | 1.75 | 1.5 |")
    ours = quality.summarise([{"step": 1200, "time": 0, "conversations": 9000, "val_expected_tau": 2.0}], 300.0,
                             evals, 90.0)
    assert set(s) == set(ours)  # the same numbers dflash-quality reports


@pytest.mark.parametrize("settings, message", [
    (["--data", "d"], "--data is no longer accepted; use data.path=DIR"),
    (["--experiment=qwen25_coder_05b_1xh100"], '--experiment is no longer accepted; use train=["+experiment=NAME"]'),
    (["--seq-len", "2048"], "--seq-len is no longer accepted; use modelopt.seq_len=N"),
    (["--eval"], "--eval is no longer accepted; use nothing (the evaluation always runs)"),
    (["modelopt.seqlen=2048"], "unknown key modelopt.seqlen (did you mean modelopt.seq_len?)"),
    (["modelopt.seq_len=long"], "wrong type for modelopt.seq_len='long': could not be converted to Integer"),
    (["modelopt.seq_len=0"], "modelopt.seq_len=0 must be a positive number of tokens"),
    (["seconds_per_step=0.2"], "seconds_per_step=0.2 startup_s=0 are dflash-train's timings; Model-Optimizer's "
                               "steps are timed in the run itself (probe_steps, warmup_steps)"),
    (["checkpoint_s=2.5"], "checkpoint_s=2.5: dflash-train's timings for dflash-quality's plan; this comparison "
                           "times its own steps in the run itself"),
    (["data.val_rows=0"], "data.val_rows=0: the held-out expected tau needs at least one held-out row"),
    (["budget_min=-1"], "budget_min=-1 must be a finite number >= 0"),  # the schema's range check, before dflash-quality's own
    (["~data.path", "datagen_budget_min=3"], "datagen_budget_min=3: this comparison trains on a given data set; give "
                                             "data.path=DIR (a dflash-datagen output, the one dflash-quality trains on)"),
])
def test_bad_settings_are_refused_in_one_line(tmp_path, capsys, settings, message):
    base = ["target=smollm2_135m", f"data.path={tmp_path}", "budget_min=1", f"run_dir={tmp_path / 'run'}"]
    with pytest.raises(SystemExit) as exit_info:
        mo.main([*base, *settings])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == f"modelopt_quality: error: {message}"
    assert not (tmp_path / "run").exists()


def test_a_run_dir_with_other_settings_or_files_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    settings = mo.settings(*mo.load(GPU_RUN))
    mo.check_run_dir(run_dir, settings)
    assert json.loads((run_dir / "run.json").read_text()) == {"written_by": "modelopt_quality", "settings": settings}
    (run_dir / "train.json").write_text("{}")
    mo.check_run_dir(run_dir, settings)  # the same settings: its finished stages are reused
    with pytest.raises(ValueError) as err:
        mo.check_run_dir(run_dir, mo.settings(*mo.load([*GPU_RUN, "budget_min=10", "modelopt.seq_len=3072"])))
    assert str(err.value) == (f"run_dir '{run_dir}' holds a run with other settings (budget_min 5.0 -> 10.0; "
                              "modelopt.seq_len 4096 -> 3072): rerun with its settings to finish it, or use a new run_dir")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"holds files modelopt_quality did not write \(notes.txt\)"):
        mo.check_run_dir(theirs, settings)


def test_a_padded_row_is_whole_blocks():
    """The batch is what Model-Optimizer's forward gets: a multiple of the block, ids as long."""
    row = {"input_ids": list(range(1, 21)), "loss_mask": [0] * 5 + [1] * 15}
    batch = mo.modelopt_batch(row, 3072, mo.padded_length(20, 16), 0, "cpu")
    assert batch["input_ids"].shape == (1, 32) and batch["input_ids"].dtype == torch.long
    assert int(batch["attention_mask"].sum()) == 20 and int((batch["labels"] != -100).sum()) == 15


def test_the_side_by_side_table_has_one_row_per_trainer_and_budget(tmp_path):
    import importlib.util

    path = Path(mo.__file__).parent / "modelopt-side-by-side" / "table.py"
    spec = importlib.util.spec_from_file_location("side_by_side_table", path)
    side = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(side)
    evals = {"mtbench": {"tau": 1.5, "num_prompts": 40}, "sharegpt-heldout": {"tau": 1.25, "num_prompts": 40}}
    ours = quality.summarise([{"step": 900, "time": 0, "conversations": 11700, "val_expected_tau": 1.61}], 312.0,
                             evals, 66.0)
    theirs = mo.summary({"train_minutes": 5.02, "steps": 800, "conversations": 800}, 1.234, evals, 72.0)
    for name, summary in [("dflash-10", ours), ("modelopt-5", theirs), ("dflash-5", ours), ("guard0", ours)]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "quality.json").write_text(json.dumps(summary))
    assert side.side_by_side(side.run_rows(tmp_path)) == (
        "| trainer | budget min | training min | steps | conversations | held-out expected tau | held-out tau (blocks) "
        "| tau mtbench (40) | tau sharegpt-heldout (40) | eval min |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
        "| dflash-train | 5 | 5.2 | 900 | 11700 | 1.61 | - | 1.50 | 1.25 | 1.1 |\n"
        "| Model-Optimizer 0.47 | 5 | 5.0 | 800 | 800 | 1.23 | - | 1.50 | 1.25 | 1.2 |\n"
        "| dflash-train | 10 | 5.2 | 900 | 11700 | 1.61 | - | 1.50 | 1.25 | 1.1 |")
    (tmp_path / "modelopt-10").mkdir()
    (tmp_path / "modelopt-10" / "quality.json").write_text(json.dumps({**theirs, "tau": {"mtbench": 1.5}}))
    with pytest.raises(ValueError, match=r"^Model-Optimizer 0.47 at 10 min was evaluated on \['mtbench'\], not "
                                         r"\['mtbench', 'sharegpt-heldout'\]$"):
        side.side_by_side(side.run_rows(tmp_path))
