"""A quality run within a wall-clock budget: `dflash-quality`.

    dflash-quality target=qwen25_coder_05b data.path=../shared/data/sharegpt-qwen25-coder-05b \\
        budget_min=20 run_dir=runs/quality-qwen25-coder 'train=["+experiment=qwen25_coder_05b_1xh100"]'

Four stages, each the project's own command, after an optional fifth that makes the data:
  0. datagen dflash-datagen (datagen_recipe, default datagen_all_turns) into <run_dir>/data for
             datagen_budget_min minutes after loading the target (magpie prompts, answers), when
             data.path is not given: the target writes its own training set; the eval datasets
             are excluded from its prompts
  1. probe   dflash-train for a few steps (a metric line per step) on the train stage's
             shapes: seconds per step after the warm-up steps (compilation), what one
             checkpoint, one validation of the held-out rows and the final save and export
             take; then a second short launch for the start-up the train stage will see
             (the first paid a GGUF's conversion and the compilers' cold runs once)
  2. plan    max_steps = the most steps whose stage fits the budget with its start-up,
             validations, checkpoints and export counted (plan.json lists each part); the
             recipe's warmup + decay schedule spans exactly those steps (optim.schedule_steps)
  3. train   dflash-train with that plan and data.val_rows held out; exports the drafter
  4. eval    dflash-eval of the export on MT-Bench and HumanEval (first N prompts, M tokens)
and prints one table: training minutes, steps, conversations seen, held-out expected tau (from
the per-slot accuracies), held-out tau counted block by block (val_tau), tau per eval dataset
(also written to <run_dir>/quality.json), and with a datagen stage a second one: its minutes,
conversations, tokens and answer tokens.
Settings are Hydra overrides of recipes/quality.yaml (or of the recipe --config-name names),
which says what each key does. target=NAME and every target.KEY=VALUE of the command line go
to both dflash-train and dflash-eval (a local target folder: target.name=/models/qwen25-coder-05b);
datagen=[...], train=[...] and eval=[...] list each stage's own overrides, each item quoted. A finished
stage is reused, so an interrupted run continues with the same plan; the train stage
checkpoints about ten times and resumes from the latest checkpoint, its minutes summed over
attempts. The run's settings are kept in <run_dir>/run.json: a rerun with another budget,
target, data or override is refused with the setting that changed (a new run_dir starts a
new plan). Without a CUDA GPU the stages run on the CPU: dense attention masks for training
and device=cpu for the evaluation; logging.wandb=disabled where wandb is not installed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import MISSING

from dflash_train.config import TargetConfig, TrainConfig
from dflash_train.console import command_lines
from dflash_train.data.format import read_manifest
from dflash_train.data.prompts import benchmark_source
from dflash_train.errors import check_own_folder, check_writable_dir, run_command
from dflash_train.recipe import HINT, compose_recipe, parse_command_line, quote_value, recipe_choices, to_config
from dflash_train.run_lock import hold_folder, stage_env
from dflash_train.training.run_dir import METRICS_FILE

# The budget ends the run, not the epochs: this only has to exceed any budget's steps.
UNBOUNDED_EPOCHS = 1000
DATASETS = ("mtbench", "humaneval")
RUN_FILE, PLAN_FILE = "run.json", "plan.json"
# What dflash-quality writes into run_dir; its stages check their own folders.
OWN_FILES = (RUN_FILE, PLAN_FILE, "datagen_seconds.json", "train_seconds.json", "eval_seconds.json", "quality.json",
             "data/*", "probe/*", "train/*", "eval/*")
DATA_DIR = "data"  # the datagen stage's output inside run_dir
# The train stage's checkpoints over its steps, the final save included (about: an interval
# of ceil(steps / CHECKPOINTS)), unless train=[...] sets checkpoint.every.
CHECKPOINTS = 10
# The plan's checkpoint.every while composing the train stage's recipe to see whether
# train=[...] sets one: no recipe can hold it (intervals are >= 0).
UNSET = -1
# The probe's steps beyond the steady ones: one that carries a checkpoint, one a validation.
PROBE_EXTRA_STEPS = 2
# Settings added after runs were recorded, with the value those runs had in effect.
ADDED_SETTINGS = {"validation_s": 0.0, "checkpoint_s": 0.0, "export_s": 0.0, "nproc": 1}
# The target keys dflash-datagen takes (data_gen.config.TargetConfig's fields; data_gen sits
# above this module, so they are named here and a test holds them equal): the command line's
# other target keys (target.compile) are training's.
DATAGEN_TARGET_KEYS = ("name", "dtype", "mask_token_id", "num_layers")


@dataclass
class QualityData:
    """dflash-train's data keys that dflash-quality sets (the same names)."""

    # A dflash-datagen output folder; None with datagen_budget_min: generated into <run_dir>/data.
    path: str | None = None
    val_rows: int = 64


@dataclass
class QualityConfig:
    """Every setting of dflash-quality; recipes/quality.yaml says what each one does."""

    target: TargetConfig = field(default_factory=TargetConfig)  # the group both stages get
    data: QualityData = field(default_factory=QualityData)
    budget_min: float = field(default=MISSING, metadata={HINT: "<training minutes>"})
    run_dir: str = "runs/quality"
    datagen_budget_min: float | None = None
    datagen_recipe: str = "datagen_all_turns"
    probe_steps: int = 8
    warmup_steps: int = 3
    seconds_per_step: float | None = None
    startup_s: float = 0.0
    validation_s: float = 0.0
    checkpoint_s: float = 0.0
    export_s: float = 0.0
    datasets: list[str] = field(default_factory=lambda: list(DATASETS))
    limit: int = 40
    max_new_tokens: int = 256
    device: str | None = None
    nproc: int = 1
    datagen: list[str] = field(default_factory=list)
    train: list[str] = field(default_factory=list)
    eval: list[str] = field(default_factory=list)


@dataclass
class QualityRun:
    """The settings and what the stage commands are built from besides them."""

    cfg: QualityConfig
    target_recipe: str  # recipes/target/<name>.yaml
    # The command line's target.KEY=VALUE overrides: both stages get them as written (the
    # composed cfg.target cannot be passed on, a train override such as +experiment=... may
    # set target keys of its own).
    target_overrides: list[str] = field(default_factory=list)
    machine: list[str] = field(default_factory=list)  # machine_defaults, once the machine is known

    @property
    def target_args(self) -> list[str]:
        return [f"target={self.target_recipe}", *self.target_overrides]

    @property
    def data_path(self) -> str:
        """The training data: data.path, or what the datagen stage writes."""
        return self.cfg.data.path or str(Path(self.cfg.run_dir) / DATA_DIR)


# The flags before dflash-quality took key=value settings: refused, naming what replaced each.
RETIRED_FLAGS = {"--target": "target=NAME", "--data": "data.path=DIR", "--budget-min": "budget_min=MINUTES",
                 "--run-dir": "run_dir=DIR", "--probe-steps": "probe_steps=N", "--warmup-steps": "warmup_steps=N",
                 "--seconds-per-step": "seconds_per_step=S", "--startup-s": "startup_s=S",
                 "--val-rows": "data.val_rows=N", "--datasets": "datasets=[a,b]", "--limit": "limit=N",
                 "--max-new-tokens": "max_new_tokens=N", "--device": "device=DEVICE",
                 "--set": "target.KEY=VALUE (both stages), train=[...] or eval=[...]", "--eval": "eval=[KEY=VALUE,...]"}


def load(argv: list[str]) -> QualityRun:
    """The validated settings of a command line (``--config-name``, ``key=value``)."""
    line = parse_command_line(argv, "quality", __doc__, retired=RETIRED_FLAGS)
    cfg = to_config(QualityConfig, compose_recipe(QualityConfig, line.config_name, line.overrides), validate)
    target_keys = [o for o in line.overrides if o.split("=", 1)[0].lstrip("+~").startswith("target.")]
    return QualityRun(cfg, recipe_choices(line.config_name, line.overrides)["target"], target_keys)


def _metrics(out_dir: Path) -> list[dict]:
    path = out_dir / METRICS_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def step_timing(lines: list[dict], warmup: int, launched: float, per_step: float | None = None) -> tuple[float, float]:
    """(seconds per step after ``warmup`` steps, start-up seconds) from one-line-per-step metrics.

    Start-up is what the first ``warmup`` steps took beyond steady steps: loading, compiling.
    ``per_step`` given (another launch's): only the start-up is measured here.
    """
    times = {m["step"]: m["time"] for m in lines}
    last = max(times, default=0)
    if warmup < 1 or last <= warmup:
        raise ValueError(f"the probe logged {last} steps; it needs more than warmup_steps={warmup}")
    if per_step is None:
        per_step = (times[last] - times[warmup]) / (last - warmup)
    startup = max(0.0, times[warmup] - launched - warmup * per_step)
    return per_step, startup


@dataclass
class StageCosts:
    """Seconds the train stage spends: start-up (loading, compiling), one step, one validation,
    one checkpoint (the final save is one) and, after the final save, the export and the exit."""

    per_step: float
    startup: float = 0.0
    validation: float = 0.0
    checkpoint: float = 0.0
    export: float = 0.0


def probe_costs(lines: list[dict], warmup: int, launched: float, finished: float) -> StageCosts:
    """The train stage's costs from the probe's metric lines (one a step, the time each was
    written) and the probe's launch and finish. The probe of P steps is timed in steps 1..P-2
    (the first ``warmup`` of them start-up), writes a checkpoint after step P-2's line (so it
    is in step P-1's time), validates at step P before its line, then saves and exports.
    With checkpoint.async_write a checkpoint costs the time training stopped for it: its
    write overlaps the next steps (in their times), and the final save's write is waited for
    before the export (in the export's time)."""
    times = {m["step"]: m["time"] for m in lines}
    last = max(times, default=0)
    if last < warmup + 1 + PROBE_EXTRA_STEPS:
        raise ValueError(f"the probe logged {last} steps; it needs warmup_steps={warmup} + {1 + PROBE_EXTRA_STEPS}")
    steady = last - PROBE_EXTRA_STEPS
    per_step, startup = step_timing([m for m in lines if m["step"] <= steady], warmup, launched)
    checkpoint = max(0.0, times[steady + 1] - times[steady] - per_step)
    validation = max(0.0, times[last] - times[steady + 1] - per_step)
    return StageCosts(per_step, startup, validation, checkpoint, max(0.0, finished - times[last] - checkpoint))


def checkpoint_interval(steps: int) -> int:
    """The plan's checkpoint.every: at most CHECKPOINTS checkpoints, the final one included."""
    return -(-steps // CHECKPOINTS)


@dataclass
class Schedule:
    """When the train stage validates and checkpoints (the trainer's rules, its settings)."""

    val_every: int  # data.val_every; 0: only at the last step
    held_out: bool  # data.val_rows > 0
    checkpoint_every: int | None  # train=[...]'s checkpoint.every; None: the plan's interval

    def validations(self, steps: int) -> int:
        """Every val_every steps and at the last step."""
        if not self.held_out:
            return 0
        return steps // self.val_every + (steps % self.val_every != 0) if self.val_every else 1

    def checkpoints(self, steps: int) -> int:
        """Every `checkpoint.every` steps before the last, then the final save."""
        every = checkpoint_interval(steps) if self.checkpoint_every is None else self.checkpoint_every
        return ((steps - 1) // every if every else 0) + 1

    def most_checkpoints(self, steps: int) -> int:
        """At least ``checkpoints(steps)`` and never fewer for more steps: the plan's interval
        grows in jumps (10 steps write 10 checkpoints, 11 write 6), this count does not."""
        return min(steps, CHECKPOINTS) if self.checkpoint_every is None else self.checkpoints(steps)


def stage_parts(steps: int, costs: StageCosts, schedule: Schedule, checkpoints: int) -> dict[str, float]:
    """The train stage's seconds, part by part, for ``steps`` steps and ``checkpoints`` saves."""
    return {"startup": costs.startup, "steps": steps * costs.per_step,
            "validations": schedule.validations(steps) * costs.validation,
            "checkpoints": checkpoints * costs.checkpoint, "export": costs.export}


def plan_steps(budget_s: float, costs: StageCosts, schedule: Schedule) -> int:
    """The most optimizer steps whose train stage fits the budget with every part counted (at
    least one). Its seconds, counted with `most_checkpoints`, grow with the steps: a search."""
    def fits(steps: int) -> bool:
        return sum(stage_parts(steps, costs, schedule, schedule.most_checkpoints(steps)).values()) <= budget_s

    low, high = 1, max(1, math.floor(budget_s / costs.per_step))
    if not fits(low):
        return 1
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def training_seconds(starts: list[float], metric_times: list[float], finished: float) -> float:
    """Wall seconds the train stage ran over its attempts: a killed attempt counts until its
    last logged step (what came after was lost and is run again), the last one until it
    finished. ``starts``: each attempt's launch time; ``metric_times``: every metric line's."""
    total = 0.0
    for i, start in enumerate(starts):
        if i == len(starts) - 1:
            end = finished
        else:
            end = max((t for t in metric_times if start <= t < starts[i + 1]), default=start)
        total += end - start
    return total


def summarise(lines: list[dict], train_seconds: float, evals: dict, eval_seconds: float) -> dict:
    """The quality table's numbers from the training metrics and dflash-eval's results;
    ``eval_seconds``: the evaluation stage's wall time, loading the target included."""
    held_out = next((m for m in reversed(lines) if "val_expected_tau" in m), None)
    return {"train_minutes": train_seconds / 60, "eval_minutes": eval_seconds / 60,
            "steps": max((m["step"] for m in lines), default=0),
            "conversations": int(sum(m.get("conversations", 0) for m in lines)),
            "val_expected_tau": None if held_out is None else held_out["val_expected_tau"],
            "val_tau": None if held_out is None else held_out.get("val_tau"),
            "tau": {name: d["tau"] for name, d in evals.items()},
            "prompts": {name: d["num_prompts"] for name, d in evals.items()}}


def table(s: dict) -> str:
    """A Markdown table, pasteable into a record under benchmarks/."""
    names = list(s["tau"])
    head = ["training min", "steps", "conversations", "held-out expected tau", "held-out tau (blocks)"] + [
        f"tau {n} ({s['prompts'][n]})" for n in names] + ["eval min"]
    # A summary written before the block-by-block tau existed has no val_tau: "-".
    held_out = ["-" if s.get(key) is None else f"{s[key]:.2f}" for key in ("val_expected_tau", "val_tau")]
    row = [f"{s['train_minutes']:.1f}", str(s["steps"]), str(s["conversations"]), *held_out] + [
        f"{s['tau'][n]:.2f}" for n in names] + [f"{s['eval_minutes']:.1f}"]
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head), "| " + " | ".join(row) + " |"])


def _run_stage(name: str, command: list[str]) -> float:
    print(command_lines(f"[{name}]", command[2:]), flush=True)
    start = time.perf_counter()
    code = subprocess.run(command, env=stage_env()).returncode
    if code != 0:
        # a stage killed by a signal prints nothing of its own: say which signal
        how = f"killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() else f"exit {code}"
        raise SystemExit(f"dflash-quality: stage {name} failed ({how}); fix the error above and run again "
                         "(finished stages are reused)")
    return time.perf_counter() - start


def machine_defaults(cuda: bool, wandb_installed: bool) -> list[str]:
    """dflash-train settings this machine needs, put before the user's overrides: dense masks
    on the CPU (flex attention has no CPU backward), no wandb where it is not installed."""
    return ([] if cuda else ["drafter.attention=dense"]) + ([] if wandb_installed else ["logging.wandb=disabled"])


def _hydra_list(values: list[str]) -> str:
    """A list value for a stage's command line, each item quoted as Hydra needs (paths)."""
    return f"[{','.join(map(quote_value, values))}]"


def _train_args(run: QualityRun, out_dir: Path, *extra: str, defaults: tuple[str, ...] = ()) -> list[str]:
    """dflash-train's overrides: ``defaults`` before the user's, ``extra`` after them (the
    plan's own); with nproc > 1, DDP unless train=[...] names another backend."""
    several = ["backend=ddp"] if run.cfg.nproc > 1 else []
    return [f"target={run.target_recipe}", f"data.path={quote_value(run.data_path)}", *run.machine, *several,
            *defaults, *run.target_overrides, *run.cfg.train, f"output_dir={quote_value(str(out_dir))}",
            f"epochs={UNBOUNDED_EPOCHS}", *extra]


def _train_command(run: QualityRun, out_dir: Path, *extra: str, defaults: tuple[str, ...] = ()) -> list[str]:
    """The probe's and train stage's dflash-train command: one process, or nproc of them on
    this host through torchrun (one a GPU), as launch/torchrun.sh starts them."""
    launcher = ["torch.distributed.run", "--standalone", f"--nproc-per-node={run.cfg.nproc}", "-m"]
    return [sys.executable, "-m", *(launcher if run.cfg.nproc > 1 else []), "dflash_train.train",
            *_train_args(run, out_dir, *extra, defaults=defaults)]


def eval_command(run: QualityRun, drafter: Path, out_dir: Path, device: str) -> list[str]:
    """The eval stage's dflash-eval command (benchmarks/modelopt_quality.py runs the same)."""
    cfg = run.cfg
    return [sys.executable, "-m", "dflash_train.eval.cli", *run.target_args, f"drafter_path={quote_value(str(drafter))}",
            f"output_dir={quote_value(str(out_dir))}", f"datasets={_hydra_list(cfg.datasets)}", f"limit={cfg.limit}",
            f"max_new_tokens={cfg.max_new_tokens}", f"device={device}", *cfg.eval]


def _datagen_command(run: QualityRun, out_dir: Path) -> list[str]:
    """dflash-datagen of the run's target into ``out_dir``; the eval datasets' prompts never
    enter the training data (before the user's datagen=[...], which may say otherwise)."""
    cfg = run.cfg
    target = [o for o in run.target_overrides if o.split("=", 1)[0].lstrip("+~").split(".", 1)[1] in DATAGEN_TARGET_KEYS]
    excluded = list(dict.fromkeys([*DATASETS, *cfg.datasets]))
    return [sys.executable, "-m", "data_gen.cli", "--config-name", cfg.datagen_recipe, f"target={run.target_recipe}",
            *target, f"out_dir={quote_value(str(out_dir))}", f"budget_min={cfg.datagen_budget_min:g}",
            f"exclude_eval={_hydra_list(excluded)}", *cfg.datagen]


def _datagen(run: QualityRun, run_dir: Path) -> None:
    """The datagen stage, once: dflash-datagen keeps its own budget over attempts (an
    interrupted run continues with what is left); its wall minutes, loading the target
    included, are summed here over attempts as the train stage's are."""
    data, timing = run_dir / DATA_DIR, run_dir / "datagen_seconds.json"
    if (data / "manifest.json").exists():
        return
    starts = json.loads(timing.read_text()).get("starts", []) if timing.exists() else []
    starts.append(time.time())
    timing.write_text(json.dumps({"starts": starts}))
    _run_stage("datagen", _datagen_command(run, data))
    written = [p.stat().st_mtime for p in data.rglob("*") if p.is_file()]
    timing.write_text(json.dumps({"starts": starts, "seconds": training_seconds(starts, written, time.time())}))


def datagen_summary(run_dir: Path) -> dict | None:
    """The datagen stage's row: minutes, conversations, tokens, answer tokens, whether its
    budget ended it (None without that stage)."""
    manifest = run_dir / DATA_DIR / "manifest.json"
    if not manifest.exists():
        return None
    m, timing = json.loads(manifest.read_text()), run_dir / "datagen_seconds.json"
    seconds = json.loads(timing.read_text()).get("seconds", math.nan) if timing.exists() else math.nan
    c = m["counts"]
    return {"minutes": seconds / 60, "conversations": c["rows"], "tokens": c["tokens"],
            "answer_tokens": c["response_tokens"], "budget_reached": bool(m.get("budget", {}).get("reached"))}


def datagen_table(d: dict) -> str:
    return ("| generation min | conversations | tokens | answer tokens | stopped by the budget |\n|---|---|---|---|---|\n"
            f"| {d['minutes']:.1f} | {d['conversations']} | {d['tokens']} | {d['answer_tokens']} | "
            f"{'yes' if d['budget_reached'] else 'no'} |")


def stage_schedule(run: QualityRun) -> Schedule:
    """When the train stage will validate and checkpoint: its recipe composed with its
    overrides, the plan's checkpoint interval UNSET to see whether train=[...] sets one."""
    raw = compose_recipe(TrainConfig, "train", _train_args(
        run, Path(run.cfg.run_dir) / "train", defaults=(f"checkpoint.every={UNSET}",)))
    every = raw.checkpoint.every
    return Schedule(raw.data.val_every, run.cfg.data.val_rows > 0, None if every == UNSET else every)


def _probe(run: QualityRun, run_dir: Path) -> tuple[StageCosts, float]:
    """The probe stage: the train stage's settings for a few steps, one checkpoint, one
    validation of the held-out rows and the export, each timed (`probe_costs`); then the
    start-up again, in a second short launch. Returns the costs, whose start-up is the
    second launch's, and the first launch's start-up.

    The first launch pays what a process pays once on a machine: a GGUF target's conversion
    (cached beside it), the compilers' first runs (their caches). The train stage starts
    after it and pays neither: on one H100 the first launch's start-up was 131 s and the
    train stage's about 30 (2026-11-28), so a plan that counted 131 left a quarter of a
    7-minute budget unused."""
    cfg, steps = run.cfg, run.cfg.probe_steps
    lines, launched, finished = _probe_launch(run, run_dir / "probe", f"max_steps={steps}",
                                              f"checkpoint.every={steps - PROBE_EXTRA_STEPS}", "export=true")
    costs = probe_costs(lines, cfg.warmup_steps, launched, finished)
    # The warm start: the warm-up steps and one more, whose line is written before the final
    # validation and save (nothing after it is timed).
    lines, launched, _ = _probe_launch(run, run_dir / "probe-warm", f"max_steps={cfg.warmup_steps + 1}",
                                       "checkpoint.every=0", "export=false")
    _, warm_startup = step_timing(lines, cfg.warmup_steps, launched, per_step=costs.per_step)
    return dataclasses.replace(costs, startup=warm_startup), costs.startup


def _probe_launch(run: QualityRun, folder: Path, *overrides: str) -> tuple[list[dict], float, float]:
    """One dflash-train launch of the probe into ``folder`` (removed after): its metric lines,
    one a step, and when it was launched and finished."""
    shutil.rmtree(folder, ignore_errors=True)
    launched = time.time()
    _run_stage("probe", _train_command(
        run, folder, *overrides, "logging.every=1", "logging.progress_bar=false", "logging.wandb=disabled",
        "checkpoint.resume=false", f"data.val_rows={run.cfg.data.val_rows}", "data.val_every=0"))
    finished = time.time()
    lines = _metrics(folder)
    shutil.rmtree(folder)
    return lines, launched, finished


def _plan(run: QualityRun, run_dir: Path) -> dict:
    """The stage's costs (probed, or given) and the steps the budget allows with all of
    them counted; kept in plan.json with the seconds of each part."""
    cfg, path = run.cfg, run_dir / PLAN_FILE
    if path.exists():
        return json.loads(path.read_text())
    schedule = stage_schedule(run)
    cold_startup = None
    if cfg.seconds_per_step:
        costs = StageCosts(cfg.seconds_per_step, cfg.startup_s, cfg.validation_s, cfg.checkpoint_s, cfg.export_s)
    else:
        costs, cold_startup = _probe(run, run_dir)
    steps = plan_steps(cfg.budget_min * 60, costs, schedule)
    parts = stage_parts(steps, costs, schedule, schedule.checkpoints(steps))
    plan = {"budget_min": cfg.budget_min, "seconds_per_step": costs.per_step, "startup_s": costs.startup,
            "validation_s": costs.validation, "checkpoint_s": costs.checkpoint, "export_s": costs.export,
            "steps": steps, "validations": schedule.validations(steps), "checkpoints": schedule.checkpoints(steps),
            "parts_s": parts, "total_s": sum(parts.values()),
            **({} if cold_startup is None else {"probe_startup_s": cold_startup})}
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan, indent=2))
    return plan


def plan_line(plan: dict) -> str:
    """The plan in one line (a plan.json of an older version counted none of the extras)."""
    return (f"[plan] {plan['seconds_per_step']:.3f} s per step, {plan['startup_s']:.0f} s start-up, "
            f"validations {plan.get('validations', 0)} x {plan.get('validation_s', 0.0):.1f} s, "
            f"checkpoints {plan.get('checkpoints', 0)} x {plan.get('checkpoint_s', 0.0):.1f} s, "
            f"export {plan.get('export_s', 0.0):.1f} s: {plan['steps']} steps in {plan['budget_min']:g} min")


def validate(cfg: QualityConfig) -> None:
    """Values no plan can come from, each named with its key."""
    positive = {"budget_min": cfg.budget_min, "seconds_per_step": cfg.seconds_per_step,
                "probe_steps": cfg.probe_steps, "warmup_steps": cfg.warmup_steps, "limit": cfg.limit,
                "max_new_tokens": cfg.max_new_tokens, "nproc": cfg.nproc}
    for key, value in positive.items():
        if value is not None and not 0 < value < math.inf:  # NaN fails the comparison too
            raise ValueError(f"{key}={value:g} must be a positive number")
    for key, value in {"startup_s": cfg.startup_s, "data.val_rows": cfg.data.val_rows}.items():
        if not 0 <= value < math.inf:
            raise ValueError(f"{key}={value:g} must be a number >= 0")
    least = cfg.warmup_steps + 1 + PROBE_EXTRA_STEPS
    if cfg.seconds_per_step is None and cfg.probe_steps < least:
        raise ValueError(f"probe_steps={cfg.probe_steps} must be at least warmup_steps + {1 + PROBE_EXTRA_STEPS} = "
                         f"{least}: steady steps after the warm-up, then a checkpoint's and a validation's")
    if not cfg.datasets:
        raise ValueError("datasets=[] names no dataset to evaluate on: give at least one "
                         "(mtbench, humaneval, a .jsonl)")
    if cfg.datagen_budget_min is not None and not 0 < cfg.datagen_budget_min < math.inf:
        raise ValueError(f"datagen_budget_min={cfg.datagen_budget_min:g} must be a positive number")
    if (cfg.data.path is None) == (cfg.datagen_budget_min is None):
        given = "both" if cfg.data.path else "neither"
        raise ValueError(f"{given} of data.path and datagen_budget_min given: give data.path=DIR (a dflash-datagen "
                         "output) or datagen_budget_min=MINUTES (the target writes the data into run_dir/data first)")
    if cfg.datagen and cfg.datagen_budget_min is None:
        raise ValueError(f"datagen={cfg.datagen} without datagen_budget_min: there is no datagen stage to pass them to")


def settings(run: QualityRun) -> dict:
    """What the plan and the stages depend on, by key (``data.path``): every setting but
    run_dir, and the target's recipe beside its keys."""
    now = dataclasses.asdict(run.cfg)
    del now["run_dir"]
    sections = {f"{name}.{k}": v for name in ("target", "data") for k, v in now.pop(name).items()}
    return {**now, "target": run.target_recipe, **sections}


def _ours(run_dir: Path) -> bool:
    for name, key in ((RUN_FILE, "written_by"), (PLAN_FILE, "seconds_per_step")):
        if (run_dir / name).exists():
            try:
                return key in json.loads((run_dir / name).read_text())
            except (OSError, ValueError, TypeError):
                return False
    return False


def settings_changes(before: dict, now: dict) -> list[str]:
    """``key old -> new`` for every setting that differs between two recorded runs; a setting
    added since ``before`` was recorded counts as the default that run had in effect."""
    before = {**ADDED_SETTINGS, **before}
    return [f"{k} {before.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(before) | set(now))
            if before.get(k) != now.get(k)]


def check_inputs(cfg: QualityConfig) -> None:
    """The inputs the stages would refuse after minutes, refused now with their messages:
    a data.path that is not a dflash-datagen output (dflash-train's check), an eval dataset
    that does not exist (dflash-eval's)."""
    if cfg.data.path is not None:
        read_manifest(cfg.data.path)
    for name in cfg.datasets:
        benchmark_source(name)


def check_run(run: QualityRun, run_dir: Path) -> None:
    """Refuse a run dir holding a run with other settings (or not a run of ours at all);
    record this run's settings in a new one."""
    check_own_folder(run_dir, "run_dir", "dflash-quality", OWN_FILES, _ours)
    now = settings(run)
    path, plan = run_dir / RUN_FILE, run_dir / PLAN_FILE
    if path.exists():
        before = json.loads(path.read_text())["settings"]
    elif plan.exists():  # a run of an older version: only its budget was recorded
        before = {**now, "budget_min": json.loads(plan.read_text())["budget_min"]}
    else:
        before = now
    changed = settings_changes(before, now)
    if changed:
        raise ValueError(f"run_dir {str(run_dir)!r} holds a quality run with other settings ({'; '.join(changed)}): "
                         "rerun with its settings to finish it, or use a new run_dir for a new plan")
    check_inputs(run.cfg)  # before run.json records them
    check_writable_dir(run_dir, "run_dir")
    if not path.exists():
        run_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"written_by": "dflash-quality", "settings": now}, indent=2))


def _run(argv: list[str] | None) -> None:
    run = load(sys.argv[1:] if argv is None else argv)
    with hold_folder(run.cfg.run_dir, "run_dir", "dflash-quality"):
        _quality(run, Path(run.cfg.run_dir))


def _quality(run: QualityRun, run_dir: Path) -> None:
    cfg = run.cfg
    # before run.json is written; a run of one process refuses bad input without importing torch
    if cfg.nproc > 1 and 0 < (gpus := _gpus()) < cfg.nproc:  # no GPU: gloo processes on the CPU
        raise ValueError(f"nproc={cfg.nproc}: a process a GPU, and {gpus} GPU(s) are visible here")
    check_run(run, run_dir)
    cuda = _cuda()
    run.machine = machine_defaults(cuda, importlib.util.find_spec("wandb") is not None)
    if run.machine:
        print(f"[machine] dflash-train gets {' '.join(run.machine)} before your overrides "
              f"({'no CUDA GPU' if not cuda else 'wandb is not installed'})", flush=True)
    if cfg.datagen_budget_min is not None:
        _datagen(run, run_dir)
    plan = _plan(run, run_dir)
    print(plan_line(plan), flush=True)
    train_dir, eval_dir = run_dir / "train", run_dir / "eval"
    timing = run_dir / "train_seconds.json"
    if not (train_dir / "export" / "model.safetensors").exists():
        # Killed mid-training (a job's time limit, a lost machine), the same command resumes
        # from the latest of about ten checkpoints, and the minutes of every attempt count.
        n = plan["steps"]
        starts = json.loads(timing.read_text()).get("starts", []) if timing.exists() else []
        starts.append(time.time())
        timing.write_text(json.dumps({"starts": starts}))
        _run_stage("train", _train_command(
            run, train_dir, f"max_steps={n}", f"optim.schedule_steps={n}", f"data.val_rows={cfg.data.val_rows}",
            defaults=(f"checkpoint.every={checkpoint_interval(n)}",)))
        seconds = training_seconds(starts, [m["time"] for m in _metrics(train_dir)], time.time())
        timing.write_text(json.dumps({"starts": starts, "seconds": seconds}))
    eval_timing = run_dir / "eval_seconds.json"
    if not (eval_dir / "results.json").exists():
        device = cfg.device or ("cuda" if cuda else "cpu")
        eval_s = _run_stage("eval", eval_command(run, train_dir / "export", eval_dir, device))
        eval_timing.write_text(json.dumps({"seconds": eval_s}))
    evals = json.loads((eval_dir / "results.json").read_text())["datasets"]
    seconds = json.loads(timing.read_text()).get("seconds", float("nan")) if timing.exists() else float("nan")
    eval_s = json.loads(eval_timing.read_text())["seconds"] if eval_timing.exists() else float("nan")
    summary = summarise(_metrics(train_dir), seconds, evals, eval_s)
    generated = datagen_summary(run_dir) if cfg.datagen_budget_min is not None else None
    (run_dir / "quality.json").write_text(json.dumps({"plan": plan, **summary, "datagen": generated}, indent=2))
    print(f"\nquality run: target={run.target_recipe} data={run.data_path} budget={cfg.budget_min:g} min")
    if generated is not None:
        print(datagen_table(generated) + "\n")
    print(table(summary))


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


def main(argv: list[str] | None = None) -> None:
    run_command("dflash-quality", _run, argv)


if __name__ == "__main__":
    main()
