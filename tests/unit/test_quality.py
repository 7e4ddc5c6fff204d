"""dflash-quality: the budget plan, the summary table, and a CPU smoke run on a tiny target."""

import json
from pathlib import Path

import pytest

from dflash_train import quality
from dflash_train.model.target import load_tokenizer
from tests.cli_helpers import assert_one_line_error, run_cli
from tests.conftest import SMOLLM2
from tests.train_data import save_tiny_target, tiny_train_args, write_datagen_dir


def test_step_timing_leaves_out_the_warmup_steps():
    # Launched at t=100; steps 1-2 carry 30 s of loading and compiling, then 2 s per step.
    lines = [{"step": s, "time": t} for s, t in [(1, 130.0), (2, 132.0), (3, 134.0), (4, 136.0), (5, 138.0)]]
    per_step, startup = quality.step_timing(lines, warmup=2, launched=100.0)
    assert per_step == pytest.approx(2.0) and startup == pytest.approx(28.0)
    with pytest.raises(ValueError, match="the probe logged 2 steps; it needs more than --warmup-steps=2"):
        quality.step_timing(lines[:2], warmup=2, launched=100.0)


def test_plan_fits_the_budget_after_startup():
    assert quality.plan_steps(20 * 60, 0.5, 60.0) == 2280
    assert quality.plan_steps(10, 5.0, 60.0) == 1  # never zero steps


def test_summary_table():
    lines = [{"step": 10, "time": 0, "conversations": 40.0},
             {"step": 20, "time": 0, "conversations": 40.0, "val_expected_tau": 1.234}]
    evals = {"mtbench": {"tau": 1.5, "num_prompts": 40}, "humaneval": {"tau": 2.25, "num_prompts": 40}}
    s = quality.summarise(lines, 600.0, evals, 150.0)
    assert quality.table(s) == (
        "| training min | steps | conversations | held-out expected tau | tau mtbench (40) | tau humaneval (40) "
        "| eval min |\n"
        "|---|---|---|---|---|---|---|\n"
        "| 10.0 | 20 | 80 | 1.23 | 1.50 | 2.25 | 2.5 |")


# No drafter.attention: on this CPU dflash-quality picks the dense masks itself.
TINY_TRAIN = ["drafter.num_hidden_layers=1", "drafter.block_size=8", "drafter.compile=false", "data.num_anchors=6", "data.max_length=64", "optim.lr=3e-3",
              "optim.micro_batch_size=2", "optim.grad_accum_steps=1", "logging.wandb=disabled",
              "logging.progress_bar=false", "backend.device=cpu", "checkpoint.every=0"]


@pytest.mark.slow
def test_quality_run_on_a_tiny_target(tmp_path, capsys):
    tok = load_tokenizer(SMOLLM2)
    target = save_tiny_target(tmp_path / "target", tok)
    data = write_datagen_dir(tmp_path / "data", target, tok, repeat=4)
    run = tmp_path / "run"
    both = [f"target.name={target}", "target.num_layers=6", "target.mask_token_id=16", "target.dtype=float32"]
    argv = ["--target", "smollm2_135m", "--data", str(data), "--budget-min", "0.4", "--run-dir", str(run),
            "--probe-steps", "4", "--warmup-steps", "1", "--val-rows", "4", "--limit", "2",
            "--max-new-tokens", "8", "--device", "cpu", *[a for s in both for a in ("--set", s)], "--", *TINY_TRAIN]
    quality.main(argv)
    out = json.loads((run / "quality.json").read_text())
    plan = out["plan"]
    assert out["steps"] == plan["steps"] >= 1 and not (run / "probe").exists()
    assert set(out["tau"]) == {"mtbench", "humaneval"} and all(t >= 1 for t in out["tau"].values())
    assert out["val_expected_tau"] >= 1 and out["conversations"] == 2 * plan["steps"]
    eval_s = json.loads((run / "eval_seconds.json").read_text())["seconds"]
    assert out["eval_minutes"] == pytest.approx(eval_s / 60) and 0 < eval_s < 600
    lines = [json.loads(x) for x in (run / "train" / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["lr"] == pytest.approx(0.0, abs=1e-12)  # the schedule ends with the budgeted steps
    printed = capsys.readouterr().out
    assert "| training min | steps | conversations | held-out expected tau |" in printed
    # Run again: every stage is reused and the same table printed.
    quality.main(argv)
    assert quality.table(out) in capsys.readouterr().out
    # Run again with another budget: a refusal naming the change, not the stale plan.
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(SystemExit) as exit_info:
        quality.main([("0.8" if a == "0.4" else a) for a in argv])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"dflash-quality: error: --run-dir '{run}' holds a quality run with other settings (--budget-min 0.4 -> "
        "0.8): rerun with its settings to finish it, or use a new --run-dir for a new plan")
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_training_seconds_sum_the_attempts():
    # Attempt 1 launched at 100, logged steps until 160, then was killed; attempt 2 ran 200 -> 290.
    times = [110.0, 130.0, 160.0, 210.0, 250.0]
    assert quality.training_seconds([100.0, 200.0], times, finished=290.0) == pytest.approx(60.0 + 90.0)
    assert quality.training_seconds([100.0], times, finished=290.0) == pytest.approx(190.0)
    # An attempt killed before its first metric line counts nothing.
    assert quality.training_seconds([100.0, 105.0, 200.0], [250.0], 290.0) == pytest.approx(90.0)


def test_train_stage_checkpoints_unless_told_otherwise():
    args = quality._parser().parse_args(["--target", "t", "--data", "d", "--budget-min", "1", "--", "seed=1"])
    cmd = quality._train_command(args, Path("out"), "max_steps=50", defaults=("checkpoint.every=5",))
    assert cmd.index("checkpoint.every=5") < cmd.index("seed=1") < cmd.index("max_steps=50")


@pytest.mark.parametrize("flags, message", [
    (["--budget-min", "-5"], "--budget-min -5 must be a positive number"),
    (["--budget-min", "0"], "--budget-min 0 must be a positive number"),
    (["--budget-min", "nan"], "--budget-min nan must be a positive number"),
    (["--budget-min", "10", "--seconds-per-step", "0"], "--seconds-per-step 0 must be a positive number"),
    (["--budget-min", "10", "--seconds-per-step", "-1.5"], "--seconds-per-step -1.5 must be a positive number"),
    (["--budget-min", "10", "--seconds-per-step", "2", "--startup-s", "-3"], "--startup-s -3 must be a number >= 0"),
    (["--budget-min", "10", "--probe-steps", "3", "--warmup-steps", "3"], "--probe-steps 3 must exceed --warmup-steps 3"),
])
def test_budgets_and_step_times_must_be_positive(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        quality.main(["--target", "smollm2_135m", "--data", str(tmp_path), "--run-dir", str(tmp_path / "run"), *flags])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == f"dflash-quality: error: {message}"
    assert not (tmp_path / "run").exists()


def test_the_stages_get_the_machines_settings_before_the_users():
    assert quality.machine_defaults(cuda=False, wandb_installed=True) == ["drafter.attention=dense"]
    assert quality.machine_defaults(cuda=True, wandb_installed=False) == ["logging.wandb=disabled"]
    assert quality.machine_defaults(cuda=True, wandb_installed=True) == []
    args = quality._parser().parse_args(["--target", "t", "--data", "d", "--budget-min", "1", "--",
                                         "drafter.attention=flex"])
    args.machine = quality.machine_defaults(cuda=False, wandb_installed=False)
    cmd = quality._train_command(args, Path("out"))
    assert cmd.index("drafter.attention=dense") < cmd.index("drafter.attention=flex")  # the user's word wins
    assert "logging.wandb=disabled" in cmd


def test_training_flex_attention_on_the_cpu_names_the_override(tmp_path):
    tok = load_tokenizer(SMOLLM2)
    target = save_tiny_target(tmp_path / "target", tok)
    data = write_datagen_dir(tmp_path / "data", target, tok)
    done = run_cli("dflash-train", *tiny_train_args(target, data, tmp_path / "run", "drafter.attention=flex"))
    assert_one_line_error(done, "dflash-train", "drafter.attention=flex cannot train on the CPU",
                          "add drafter.attention=dense")
