"""dflash-quality: its recipe, the budget plan, the summary table, and a CPU smoke run on a tiny target."""

import json
from pathlib import Path

import pytest
import torch

from dflash_train import quality
from dflash_train.config import OptimConfig
from dflash_train.console import MAX_LINE
from dflash_train.data.format import FORMAT_VERSION
from dflash_train.model.target import load_tokenizer
from dflash_train.training.optim import scheduler_factory
from tests.cli_helpers import assert_one_line_error, readable_lines, run_cli, unwrap_commands, warm_stages
from tests.conftest import SMOLLM2
from tests.datagen_helpers import write_prompts
from tests.train_data import save_tiny_target, tiny_train_args, write_datagen_dir


def test_step_timing_leaves_out_the_warmup_steps():
    # Launched at t=100; steps 1-2 carry 30 s of loading and compiling, then 2 s per step.
    lines = [{"step": s, "time": t} for s, t in [(1, 130.0), (2, 132.0), (3, 134.0), (4, 136.0), (5, 138.0)]]
    per_step, startup = quality.step_timing(lines, warmup=2, launched=100.0)
    assert per_step == pytest.approx(2.0) and startup == pytest.approx(28.0)
    with pytest.raises(ValueError, match="the probe logged 2 steps; it needs more than warmup_steps=2"):
        quality.step_timing(lines[:2], warmup=2, launched=100.0)


def test_summary_table():
    lines = [{"step": 10, "time": 0, "conversations": 40.0},
             {"step": 20, "time": 0, "conversations": 40.0, "val_expected_tau": 1.234, "val_tau": 1.375}]
    evals = {"mtbench": {"tau": 1.5, "num_prompts": 40}, "humaneval": {"tau": 2.25, "num_prompts": 40}}
    s = quality.summarise(lines, 600.0, evals, 150.0)
    assert quality.table(s) == (
        "| training min | steps | conversations | held-out expected tau | held-out tau (blocks) | tau mtbench (40) "
        "| tau humaneval (40) | eval min |\n"
        "|---|---|---|---|---|---|---|---|\n"
        "| 10.0 | 20 | 80 | 1.23 | 1.38 | 1.50 | 2.25 | 2.5 |")
    # a summary kept from before val_tau existed
    old = {k: v for k, v in s.items() if k != "val_tau"}
    assert quality.table(old).splitlines()[2] == "| 10.0 | 20 | 80 | 1.23 | - | 1.50 | 2.25 | 2.5 |"


# No drafter.attention: on this CPU dflash-quality picks the dense masks itself.
TINY_TRAIN = ["drafter.num_hidden_layers=1", "drafter.block_size=8", "drafter.compile=false", "data.num_anchors=6", "data.max_length=64", "optim.lr=3e-3",
              "optim.micro_batch_size=2", "optim.grad_accum_steps=1", "logging.wandb=disabled",
              "logging.progress_bar=false", "backend.device=cpu", "checkpoint.every=0"]


def _lr_after(steps: int) -> float:
    """The lr after ``steps`` steps of TINY_TRAIN's schedule planned for ``steps`` steps."""
    params = [torch.zeros(1, requires_grad=True)]
    opt = torch.optim.SGD(params, lr=3e-3)
    schedule = scheduler_factory(OptimConfig(lr=3e-3, warmup_ratio=0.04), steps)(opt)
    for _ in range(steps):
        opt.step()
        schedule.step()
    return schedule.get_last_lr()[0]


def test_the_lr_after_a_planned_schedule():
    assert (_lr_after(1), _lr_after(2), _lr_after(25)) == (pytest.approx(3e-3), 0.0, 0.0)


def tiny_run(tmp_path, monkeypatch) -> tuple[Path, Path, list[str]]:
    """A tiny target's data set, the run folder and the target keys both stages get; the
    stages fork from a warm Python."""
    warm_stages(monkeypatch, quality)
    tok = load_tokenizer(SMOLLM2)
    target = save_tiny_target(tmp_path / "target", tok)
    data = write_datagen_dir(tmp_path / "data", target, tok, repeat=4)
    both = [f"target.name={target}", "target.num_layers=6", "target.mask_token_id=16", "target.dtype=float32"]
    return data, tmp_path / "run", both


@pytest.mark.slow
def test_quality_run_on_a_tiny_target(tmp_path, capsys, monkeypatch):
    data, run, both = tiny_run(tmp_path, monkeypatch)
    # 15 s: after the start-up (~1 s: its stages fork from a warm Python here) and ~1 s export an idle
    # CPU core plans a few hundred steps of 0.04 s, so the lr check below sees a schedule that decayed to its end.
    argv = ["target=smollm2_135m", f"data.path={data}", "budget_min=0.25", f"run_dir={run}", "probe_steps=4",
            "warmup_steps=1", "data.val_rows=4", "limit=2", "max_new_tokens=8", "device=cpu", *both,
            _listed("train", TINY_TRAIN)]
    quality.main(argv)
    out = json.loads((run / "quality.json").read_text())
    plan = out["plan"]
    assert out["steps"] == plan["steps"] >= 1 and not (run / "probe").exists()
    assert set(out["tau"]) == {"mtbench", "humaneval"} and all(t >= 1 for t in out["tau"].values())
    assert out["val_expected_tau"] >= 1 and out["val_tau"] >= 1 and out["conversations"] == 2 * plan["steps"]
    eval_s = json.loads((run / "eval_seconds.json").read_text())["seconds"]
    assert out["eval_minutes"] == pytest.approx(eval_s / 60) and 0 < eval_s < 600
    lines = [json.loads(x) for x in (run / "train" / "metrics.jsonl").read_text().splitlines()]
    # The schedule spans the budgeted steps: the last step's lr is where that schedule ends
    # (0 after a decay; the peak when a slow machine's plan leaves one step, all warmup).
    assert lines[-1]["step"] == plan["steps"]
    assert lines[-1]["lr"] == pytest.approx(_lr_after(plan["steps"]), abs=1e-12)
    printed = capsys.readouterr().out
    assert "| training min | steps | conversations | held-out expected tau | held-out tau (blocks) |" in printed
    # Run again: every stage is reused and the same table printed.
    quality.main(argv)
    assert quality.table(out) in capsys.readouterr().out
    # Run again with another budget: a refusal naming the change, not the stale plan.
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(SystemExit) as exit_info:
        quality.main([("budget_min=0.8" if a == "budget_min=0.25" else a) for a in argv])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"dflash-quality: error: run_dir '{run}' holds a quality run with other settings (budget_min 0.25 -> "
        "0.8): rerun with its settings to finish it, or use a new run_dir for a new plan")
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


@pytest.mark.slow
def test_quality_run_on_two_processes(tmp_path, capfd, monkeypatch):
    """nproc=2: the train stage runs as two DDP ranks through torchrun (gloo on this CPU), so
    every step trains both ranks' rows (the metrics sum them: 2 rows of one conversation each,
    a rank); the plan, export, evaluation and table as with one."""
    data, run, both = tiny_run(tmp_path, monkeypatch)
    # the plan's costs given (the probe's launches run the same command: test_several_processes_...)
    quality.main(["target=smollm2_135m", f"data.path={data}", "budget_min=0.4", f"run_dir={run}",
                  "seconds_per_step=0.5", "startup_s=15", "data.val_rows=4", "limit=2", "max_new_tokens=8",
                  "device=cpu", "nproc=2", *both, _listed("train", TINY_TRAIN)])
    out = json.loads((run / "quality.json").read_text())
    assert out["steps"] == out["plan"]["steps"] >= 1
    assert out["conversations"] == 2 * 2 * out["steps"]
    assert set(out["tau"]) == {"mtbench", "humaneval"} and out["val_expected_tau"] >= 1
    printed = capfd.readouterr().out
    assert "[train] torch.distributed.run --standalone --nproc-per-node=2 -m dflash_train.train" in printed
    assert "[eval] dflash_train.eval.cli" in printed
    assert json.loads((run / "run.json").read_text())["settings"]["nproc"] == 2


def test_several_processes_train_with_ddp_unless_told_otherwise():
    run = quality.load([*REQUIRED, "nproc=2", _listed("train", ["seed=1"])])
    cmd = quality._train_command(run, Path("out"), "max_steps=9")
    assert cmd[1:8] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                        "dflash_train.train", "target=smollm2_135m"]
    assert cmd.index("backend=ddp") < cmd.index("seed=1") < cmd.index("max_steps=9")
    fsdp = quality._train_command(quality.load([*REQUIRED, "nproc=2", _listed("train", ["backend=fsdp2"])]), Path("o"))
    assert fsdp.index("backend=ddp") < fsdp.index("backend=fsdp2")  # the user's, later, wins
    one = quality._train_command(quality.load(REQUIRED), Path("o"))
    assert one[1:3] == ["-m", "dflash_train.train"] and "backend=ddp" not in one
    # a run recorded before nproc existed had one process: the same settings, not a change
    now = quality.settings(quality.load(REQUIRED))
    assert quality.settings_changes({k: v for k, v in now.items() if k != "nproc"}, now) == []


@pytest.mark.slow
def test_quality_run_generates_its_data_first(tmp_path, capfd, monkeypatch):
    """From nothing but a target: the datagen stage writes run_dir/data within its budget
    (the eval datasets excluded), training reads it, and the table adds the stage's row.
    Every line the run prints, its stages' included, is under MAX_LINE (progress bars aside)."""
    warm_stages(monkeypatch, quality)
    tok = load_tokenizer(SMOLLM2)
    target = save_tiny_target(tmp_path / "target", tok)
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, 12)
    run = tmp_path / "run"
    both = [f"target.name={target}", "target.num_layers=6", "target.mask_token_id=16", "target.dtype=float32"]
    datagen = [f"sources=[{{kind: jsonl, path: {prompts}}}]", "shard_size=4", "backend.batch_size=4",
               "backend.cpu_threads=1", "sampling.max_new_tokens=12", "max_prompt_len=64"]
    argv = ["target=smollm2_135m", "datagen_budget_min=5", "datagen_recipe=datagen", _listed("datagen", datagen),
            "budget_min=0.2", f"run_dir={run}", "probe_steps=4", "warmup_steps=1", "data.val_rows=2", "limit=2",
            "max_new_tokens=8", "device=cpu", *both,
            _listed("train", [*TINY_TRAIN, "drafter.init_from_target=true", "logging.progress_bar=true"])]
    quality.main(argv)
    manifest = json.loads((run / "data" / "manifest.json").read_text())
    assert manifest["counts"]["rows"] == 12 and manifest["exclude_eval"] == ["mtbench", "humaneval"]
    assert manifest["budget"] == {"minutes": 5.0, "reached": False, "shards": 3, "of": 3, "prompts_unstarted": 0}
    out = json.loads((run / "quality.json").read_text())
    assert {k: out["datagen"][k] for k in ("conversations", "tokens", "answer_tokens", "budget_reached")} == {
        "conversations": 12, "tokens": manifest["counts"]["tokens"],
        "answer_tokens": manifest["counts"]["response_tokens"], "budget_reached": False}
    assert 0 < out["datagen"]["minutes"] < 5
    assert out["steps"] >= 1 and out["conversations"] >= 1
    captured = capfd.readouterr()
    printed = captured.out
    assert "| generation min | conversations | tokens | answer tokens | stopped by the budget |" in printed
    assert f"| 12 | {manifest['counts']['tokens']} | {manifest['counts']['response_tokens']} | no |" in printed
    assert f"[train] dflash_train.train target=smollm2_135m data.path={run / 'data'} " in unwrap_commands(printed)
    assert [line for line in readable_lines(captured.out + captured.err) if len(line) >= MAX_LINE] == []
    # Run again: nothing is generated or trained again; the same tables.
    before = {p: p.stat().st_mtime for p in (run / "data").rglob("*") if p.is_file()}
    quality.main(argv)
    assert {p: p.stat().st_mtime for p in (run / "data").rglob("*") if p.is_file()} == before
    assert quality.datagen_table(out["datagen"]) in capfd.readouterr().out


def test_datagen_stage_command():
    run = quality.load(["target=qwen25_coder_05b", "target.name=/m.gguf", "datagen_budget_min=6", "budget_min=15",
                        "datasets=[mtbench,humaneval,held-out.jsonl]", "run_dir=r", _listed("datagen", ["seed=3"])])
    assert quality._datagen_command(run, Path("r/data"))[3:] == [
        "--config-name", "datagen_all_turns", "target=qwen25_coder_05b", "target.name=/m.gguf", "out_dir=r/data",
        "budget_min=6", "exclude_eval=[mtbench,humaneval,held-out.jsonl]", "seed=3"]
    assert quality._train_command(run, Path("r/train"))[3:5] == ["target=qwen25_coder_05b", "data.path=r/data"]


def test_datagen_takes_the_target_keys_data_generation_has():
    from dataclasses import fields

    from data_gen.config import TargetConfig

    assert quality.DATAGEN_TARGET_KEYS == tuple(f.name for f in fields(TargetConfig))


def test_training_seconds_sum_the_attempts():
    # Attempt 1 launched at 100, logged steps until 160, then was killed; attempt 2 ran 200 -> 290.
    times = [110.0, 130.0, 160.0, 210.0, 250.0]
    assert quality.training_seconds([100.0, 200.0], times, finished=290.0) == pytest.approx(60.0 + 90.0)
    assert quality.training_seconds([100.0], times, finished=290.0) == pytest.approx(190.0)
    # An attempt killed before its first metric line counts nothing.
    assert quality.training_seconds([100.0, 105.0, 200.0], [250.0], 290.0) == pytest.approx(90.0)


def _listed(key: str, overrides: list[str]) -> str:
    """A stage's overrides as one list-valued setting, each item quoted as Hydra wants."""
    return f"{key}=[{','.join(json.dumps(o) for o in overrides)}]"


REQUIRED = ["target=smollm2_135m", "data.path=d", "budget_min=1"]


def test_train_stage_checkpoints_unless_told_otherwise():
    run = quality.load([*REQUIRED, _listed("train", ["seed=1"])])
    cmd = quality._train_command(run, Path("out"), "max_steps=50", defaults=("checkpoint.every=5",))
    assert cmd.index("checkpoint.every=5") < cmd.index("seed=1") < cmd.index("max_steps=50")


def test_recipe_defaults_and_stage_lists():
    run = quality.load(REQUIRED)
    cfg = run.cfg
    assert (cfg.run_dir, cfg.probe_steps, cfg.warmup_steps, cfg.seconds_per_step, cfg.startup_s) == (
        "runs/quality", 8, 3, None, 0.0)
    assert (cfg.validation_s, cfg.checkpoint_s, cfg.export_s) == (0.0, 0.0, 0.0)
    assert (cfg.data.path, cfg.data.val_rows, cfg.budget_min) == ("d", 64, 1.0)
    assert (cfg.datasets, cfg.limit, cfg.max_new_tokens, cfg.device) == (["mtbench", "humaneval"], 40, 256, None)
    assert (cfg.train, cfg.eval, run.target_recipe, run.target_overrides) == ([], [], "smollm2_135m", [])
    # Items of a stage list keep their '=', '+' and commas: each is one override of that stage.
    run = quality.load([*REQUIRED, _listed("train", ["+experiment=qwen25_coder_05b_1xh100", "optim.lr=1e-3"]),
                        _listed("eval", ["batch_size=4", "datasets=[mtbench,x.jsonl]"])])
    assert run.cfg.train == ["+experiment=qwen25_coder_05b_1xh100", "optim.lr=1e-3"]
    assert run.cfg.eval == ["batch_size=4", "datasets=[mtbench,x.jsonl]"]


def test_the_target_and_its_keys_go_to_both_stages():
    run = quality.load(["target=qwen3_8b", "target.name=/models/qwen3-8b", "target.dtype=float32", "data.path=d",
                        "budget_min=1", "data.val_rows=8", "datasets=[mtbench,held-out.jsonl]", "limit=5",
                        _listed("train", ["seed=1"]), _listed("eval", ["batch_size=5"])])
    assert run.cfg.target.name == "/models/qwen3-8b" and run.cfg.target.num_layers == 36  # the group's own value
    train = quality._train_command(run, Path("out"), "max_steps=9")
    assert train[3:] == ["target=qwen3_8b", "data.path=d", "target.name=/models/qwen3-8b", "target.dtype=float32",
                         "seed=1", "output_dir=out", f"epochs={quality.UNBOUNDED_EPOCHS}", "max_steps=9"]
    evaluate = quality.eval_command(run, Path("out/export"), Path("ev"), "cpu")
    assert evaluate[3:] == ["target=qwen3_8b", "target.name=/models/qwen3-8b", "target.dtype=float32",
                            "drafter_path=out/export", "output_dir=ev", "datasets=[mtbench,held-out.jsonl]",
                            "limit=5", "max_new_tokens=256", "device=cpu", "batch_size=5"]


def test_a_rerun_with_another_target_key_is_refused_by_name(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.chdir(tmp_path)
    Path("d").mkdir()  # data.path=d: a dflash-datagen output, as far as its manifest tells
    Path("d/manifest.json").write_text(json.dumps({"format_version": FORMAT_VERSION}))
    quality.check_run(quality.load([*REQUIRED, "target.name=/models/a"]), run_dir)
    recorded = json.loads((run_dir / "run.json").read_text())["settings"]
    assert (recorded["target"], recorded["target.name"], recorded["data.path"]) == ("smollm2_135m", "/models/a", "d")
    quality.check_run(quality.load([*REQUIRED, "target.name=/models/a"]), run_dir)  # the same settings: go on
    with pytest.raises(ValueError) as err:
        quality.check_run(quality.load([*REQUIRED, "target.name=/models/b", "limit=7"]), run_dir)
    assert str(err.value) == (
        f"run_dir '{run_dir}' holds a quality run with other settings (limit 40 -> 7; target.name '/models/a' -> "
        "'/models/b'): rerun with its settings to finish it, or use a new run_dir for a new plan")


@pytest.mark.parametrize("settings, message", [
    (["budget_min=-5"], "budget_min=-5 must be a finite number >= 0"),
    (["budget_min=0"], "budget_min=0 must be a positive number"),
    (["budget_min=nan"], "budget_min=nan must be a finite number >= 0"),
    (["budget_min=10", "seconds_per_step=0"], "seconds_per_step=0 must be a positive number"),
    (["budget_min=10", "seconds_per_step=-1.5"], "seconds_per_step=-1.5 must be a finite number >= 0"),
    (["budget_min=10", "seconds_per_step=2", "startup_s=-3"], "startup_s=-3 must be a finite number >= 0"),
    (["budget_min=10", "probe_steps=5", "warmup_steps=3"], "probe_steps=5 must be at least warmup_steps + 3 = 6: "
                                                           "steady steps after the warm-up, then a checkpoint's and "
                                                           "a validation's"),
    (["budget_min=10", "seconds_per_step=2", "checkpoint_s=-1"], "checkpoint_s=-1 must be a finite number >= 0"),
    (["budget_min=10", "data.val_rows=-1"], "data.val_rows=-1 must be a finite number >= 0"),
    (["budget_min=10", "nproc=0"], "nproc=0 must be a positive number"),
    (["budget_min=10", "datasets=[]"], "datasets=[] names no dataset to evaluate on: give at least one "
                                       "(mtbench, humaneval, a .jsonl)"),
    ([], "missing value for budget_min: add budget_min=<training minutes> to the command"),
    (["budget_min=ten"], "wrong type for budget_min='ten': could not be converted to Float"),
    (["budget_min=10", "budget=3"], "unknown key budget (did you mean budget_min?)"),
    (["budget_min=10", "train=[optim.lr=1e-3]"],
     "cannot parse override 'train=[optim.lr=1e-3]': no viable alternative at input '[optim.lr=' (quote a value "
     "holding '=', each item of a list of overrides: train='[\"optim.lr=1e-3\", \"seed=1\"]')"),
    (["budget_min=10", "--budget-min", "3"], "--budget-min is no longer accepted; use budget_min=MINUTES"),
    (["budget_min=10", "--budget", "3"], "unknown option --budget (options: --config-name, -cn; settings are key=value)"),
    (["budget_min=10", "datagen_budget_min=3"], "both of data.path and datagen_budget_min given: give data.path=DIR "
     "(a dflash-datagen output) or datagen_budget_min=MINUTES (the target writes the data into run_dir/data first)"),
    (["budget_min=10", "datagen_budget_min=0"], "datagen_budget_min=0 must be a positive number"),
    (["budget_min=10", _listed("datagen", ["seed=1"])],
     "datagen=['seed=1'] without datagen_budget_min: there is no datagen stage to pass them to"),
])
def test_bad_settings_are_refused_in_one_line(tmp_path, capsys, settings, message):
    with pytest.raises(SystemExit) as exit_info:
        quality.main(["target=smollm2_135m", f"data.path={tmp_path}", f"run_dir={tmp_path / 'run'}", *settings])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == f"dflash-quality: error: {message}"
    assert not (tmp_path / "run").exists()


def test_the_target_recipe_is_required_and_config_name_picks_the_recipe(tmp_path, capsys):
    for argv, message in [
        ([f"data.path={tmp_path}", "budget_min=1"],
         "missing value for target: add target=<llama31_8b | qwen25_7b | qwen25_coder_05b | qwen3_4b | qwen3_8b | "
         "smollm2_135m> to the command"),
        (["target=qwen9", f"data.path={tmp_path}", "budget_min=1"], "no recipe 'target/qwen9'; options: llama31_8b, "
         "qwen25_7b, qwen25_coder_05b, qwen3_4b, qwen3_8b, smollm2_135m"),
        (["--config-name", "quality_nope", *REQUIRED], "Cannot find primary config 'quality_nope'"),
    ]:
        with pytest.raises(SystemExit):
            quality.main(argv)
        assert capsys.readouterr().err.strip().startswith(f"dflash-quality: error: {message}")
    with pytest.raises(SystemExit):
        quality.main(["--config-name", "train", "output_dir=o", "data.path=d"])  # not a quality recipe
    assert capsys.readouterr().err.strip().startswith("dflash-quality: error: unknown key ")


def test_the_stages_get_the_machines_settings_before_the_users():
    assert quality.machine_defaults(cuda=False, wandb_installed=True) == ["drafter.attention=dense"]
    assert quality.machine_defaults(cuda=True, wandb_installed=False) == ["logging.wandb=disabled"]
    assert quality.machine_defaults(cuda=True, wandb_installed=True) == []
    run = quality.load([*REQUIRED, _listed("train", ["drafter.attention=flex"])])
    run.machine = quality.machine_defaults(cuda=False, wandb_installed=False)
    cmd = quality._train_command(run, Path("out"))
    assert cmd.index("drafter.attention=dense") < cmd.index("drafter.attention=flex")  # the user's word wins
    assert "logging.wandb=disabled" in cmd


def test_training_flex_attention_on_the_cpu_names_the_override(tmp_path):
    tok = load_tokenizer(SMOLLM2)
    target = save_tiny_target(tmp_path / "target", tok)
    data = write_datagen_dir(tmp_path / "data", target, tok)
    done = run_cli("dflash-train", *tiny_train_args(target, data, tmp_path / "run", "drafter.attention=flex"))
    assert_one_line_error(done, "dflash-train", "drafter.attention=flex cannot train on the CPU",
                          "add drafter.attention=dense")


def test_an_older_run_with_only_its_plan_is_refused_under_another_budget(tmp_path):
    """Runs of older versions recorded only plan.json: its budget is the run's setting."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / quality.PLAN_FILE).write_text(json.dumps({"budget_min": 1, "seconds_per_step": 0.5, "startup_s": 0,
                                                         "steps": 120}))
    with pytest.raises(ValueError, match=r"holds a quality run with other settings \(budget_min 1 -> 2.0\)"):
        quality.check_run(quality.load([*REQUIRED[:2], "budget_min=2", f"run_dir={run_dir}"]), run_dir)
