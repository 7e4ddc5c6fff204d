"""A quality run within a wall-clock budget: `dflash-quality`.

    dflash-quality --target qwen25_coder_05b --data ../shared/data/sharegpt-qwen25-coder-05b \\
        --budget-min 20 --run-dir runs/quality-qwen25-coder -- +experiment=qwen25_coder_05b_1xh100

Four stages, each the project's own command:
  1. probe   dflash-train for a few steps (a metric line per step, no export): seconds per
             step after the warm-up steps (compilation) and the start-up time before them
  2. plan    max_steps = (budget - start-up) / seconds per step; the warmup + cosine schedule
             spans exactly those steps (optim.schedule_steps), whatever the epochs would say
  3. train   dflash-train with that plan and data.val_rows held out; exports the drafter
  4. eval    dflash-eval of the export on MT-Bench and HumanEval (first N prompts, M tokens)
and prints one table: training minutes, steps, conversations seen, held-out expected tau,
tau per eval dataset (also written to <run-dir>/quality.json). Arguments after `--` are
dflash-train overrides; `--set KEY=VALUE` goes to both dflash-train and dflash-eval (a
local target folder: `--set target.name=/models/qwen25-coder-05b`). A finished stage is
reused, so an interrupted run continues with the same plan; the train stage checkpoints
about ten times and resumes from the latest checkpoint, its minutes summed over attempts.
The run's settings are kept in <run-dir>/run.json: a rerun with another budget, target, data
or override is refused with the setting that changed (a new --run-dir starts a new plan).
Without a CUDA GPU the stages run on the CPU: dense attention masks for training and
device=cpu for the evaluation; logging.wandb=disabled where wandb is not installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

from dflash_train.errors import check_own_folder, check_writable_dir, run_command
from dflash_train.training.logging import METRICS_FILE

# The budget ends the run, not the epochs: this only has to exceed any budget's steps.
UNBOUNDED_EPOCHS = 1000
DATASETS = ("mtbench", "humaneval")
RUN_FILE, PLAN_FILE = "run.json", "plan.json"
# What dflash-quality writes into --run-dir; its stages check their own folders.
OWN_FILES = (RUN_FILE, PLAN_FILE, "train_seconds.json", "eval_seconds.json", "quality.json", "probe/*", "train/*",
             "eval/*")


def _metrics(out_dir: Path) -> list[dict]:
    path = out_dir / METRICS_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def step_timing(lines: list[dict], warmup: int, launched: float) -> tuple[float, float]:
    """(seconds per step after ``warmup`` steps, start-up seconds) from one-line-per-step metrics.

    Start-up is what the first ``warmup`` steps took beyond steady steps: loading, compiling.
    """
    times = {m["step"]: m["time"] for m in lines}
    last = max(times, default=0)
    if warmup < 1 or last <= warmup:
        raise ValueError(f"the probe logged {last} steps; it needs more than --warmup-steps={warmup}")
    per_step = (times[last] - times[warmup]) / (last - warmup)
    startup = max(0.0, times[warmup] - launched - warmup * per_step)
    return per_step, startup


def plan_steps(budget_s: float, per_step: float, startup: float) -> int:
    """Optimizer steps that fit the budget after start-up (at least one)."""
    return max(1, math.floor((budget_s - startup) / per_step))


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
            "tau": {name: d["tau"] for name, d in evals.items()},
            "prompts": {name: d["num_prompts"] for name, d in evals.items()}}


def table(s: dict) -> str:
    """A Markdown table, pasteable into the README."""
    names = list(s["tau"])
    head = ["training min", "steps", "conversations", "held-out expected tau"] + [
        f"tau {n} ({s['prompts'][n]})" for n in names] + ["eval min"]
    val = "-" if s["val_expected_tau"] is None else f"{s['val_expected_tau']:.2f}"
    row = [f"{s['train_minutes']:.1f}", str(s["steps"]), str(s["conversations"]), val] + [
        f"{s['tau'][n]:.2f}" for n in names] + [f"{s['eval_minutes']:.1f}"]
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head), "| " + " | ".join(row) + " |"])


def _run_stage(name: str, command: list[str]) -> float:
    print(f"[{name}] {' '.join(command[2:])}", flush=True)
    start = time.perf_counter()
    if subprocess.run(command).returncode != 0:
        raise SystemExit(f"dflash-quality: stage {name} failed; fix the error above and run again "
                         "(finished stages are reused)")
    return time.perf_counter() - start


def machine_defaults(cuda: bool, wandb_installed: bool) -> list[str]:
    """dflash-train settings this machine needs, put before the user's overrides: dense masks
    on the CPU (flex attention has no CPU backward), no wandb where it is not installed."""
    return ([] if cuda else ["drafter.attention=dense"]) + ([] if wandb_installed else ["logging.wandb=disabled"])


def _train_command(args, out_dir: Path, *extra: str, defaults: tuple[str, ...] = ()) -> list[str]:
    """``defaults`` come before the user's overrides, ``extra`` after them (the plan's own)."""
    return [sys.executable, "-m", "dflash_train.train", f"target={args.target}", f"data.path={args.data}",
            *args.machine, *defaults, *args.set, *args.train, f"output_dir={out_dir}", f"epochs={UNBOUNDED_EPOCHS}",
            *extra]


def _plan(args, run_dir: Path) -> dict:
    """Seconds per step (probed, or given) and the steps the budget allows; kept in plan.json."""
    path = run_dir / PLAN_FILE
    if path.exists():
        return json.loads(path.read_text())
    if args.seconds_per_step:
        per_step, startup = args.seconds_per_step, args.startup_s
    else:
        probe = run_dir / "probe"
        shutil.rmtree(probe, ignore_errors=True)
        launched = time.time()
        _run_stage("probe", _train_command(
            args, probe, f"max_steps={args.probe_steps}", "logging.every=1", "logging.progress_bar=false",
            "logging.wandb=disabled", "export=false", "checkpoint.every=0", "checkpoint.resume=false",
            "data.val_rows=0"))
        per_step, startup = step_timing(_metrics(probe), args.warmup_steps, launched)
        shutil.rmtree(probe)
    plan = {"budget_min": args.budget_min, "seconds_per_step": per_step, "startup_s": startup,
            "steps": plan_steps(args.budget_min * 60, per_step, startup)}
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan, indent=2))
    return plan


def check_args(args) -> None:
    """Values no plan can come from, each named with the flag that holds it."""
    positive = {"--budget-min": args.budget_min, "--seconds-per-step": args.seconds_per_step,
                "--probe-steps": args.probe_steps, "--warmup-steps": args.warmup_steps, "--limit": args.limit,
                "--max-new-tokens": args.max_new_tokens}
    for flag, value in positive.items():
        if value is not None and not 0 < value < math.inf:  # NaN fails the comparison too
            raise ValueError(f"{flag} {value:g} must be a positive number")
    for flag, value in {"--startup-s": args.startup_s, "--val-rows": args.val_rows}.items():
        if not 0 <= value < math.inf:
            raise ValueError(f"{flag} {value:g} must be a number >= 0")
    if args.seconds_per_step is None and args.probe_steps <= args.warmup_steps:
        raise ValueError(f"--probe-steps {args.probe_steps} must exceed --warmup-steps {args.warmup_steps}")


def settings(args) -> dict:
    """What the plan and the stages depend on: every flag but --run-dir."""
    return {k: v for k, v in vars(args).items() if k not in ("run_dir", "machine")}


def _ours(run_dir: Path) -> bool:
    for name, key in ((RUN_FILE, "written_by"), (PLAN_FILE, "seconds_per_step")):
        if (run_dir / name).exists():
            try:
                return key in json.loads((run_dir / name).read_text())
            except (OSError, ValueError, TypeError):
                return False
    return False


def check_run(args, run_dir: Path) -> None:
    """Refuse a run dir holding a run with other settings (or not a run of ours at all);
    record this run's settings in a new one."""
    check_own_folder(run_dir, "--run-dir", "dflash-quality", OWN_FILES, _ours)
    now = settings(args)
    path, plan = run_dir / RUN_FILE, run_dir / PLAN_FILE
    if path.exists():
        before = json.loads(path.read_text())["settings"]
    elif plan.exists():  # a run of an older version: only its budget was recorded
        before = {**now, "budget_min": json.loads(plan.read_text())["budget_min"]}
    else:
        before = now
    changed = [f"{_flag(k)} {before.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(before) | set(now))
               if before.get(k) != now.get(k)]
    if changed:
        raise ValueError(f"--run-dir {str(run_dir)!r} holds a quality run with other settings ({'; '.join(changed)}): "
                         "rerun with its settings to finish it, or use a new --run-dir for a new plan")
    check_writable_dir(run_dir, "--run-dir")
    if not path.exists():
        run_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"written_by": "dflash-quality", "settings": now}, indent=2))


def _flag(key: str) -> str:
    return "overrides after --" if key == "train" else "--" + key.replace("_", "-")


def _run(argv: list[str] | None) -> None:
    args = _parser().parse_args(argv)
    check_args(args)
    run_dir = args.run_dir
    check_run(args, run_dir)
    cuda = _cuda()
    if args.device is None:
        args.device = "cuda" if cuda else "cpu"
    args.machine = machine_defaults(cuda, importlib.util.find_spec("wandb") is not None)
    if args.machine:
        print(f"[machine] dflash-train gets {' '.join(args.machine)} before your overrides "
              f"({'no CUDA GPU' if not cuda else 'wandb is not installed'})", flush=True)
    plan = _plan(args, run_dir)
    print(f"[plan] {plan['seconds_per_step']:.3f} s per step, {plan['startup_s']:.0f} s start-up: "
          f"{plan['steps']} steps in {args.budget_min:g} min", flush=True)
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
            args, train_dir, f"max_steps={n}", f"optim.schedule_steps={n}", f"data.val_rows={args.val_rows}",
            defaults=(f"checkpoint.every={max(1, n // 10)}",)))
        seconds = training_seconds(starts, [m["time"] for m in _metrics(train_dir)], time.time())
        timing.write_text(json.dumps({"starts": starts, "seconds": seconds}))
    eval_timing = run_dir / "eval_seconds.json"
    if not (eval_dir / "results.json").exists():
        eval_s = _run_stage("eval", [sys.executable, "-m", "dflash_train.eval.cli", f"target={args.target}",
                                     *args.set, f"drafter_path={train_dir / 'export'}", f"output_dir={eval_dir}",
                                     f"datasets=[{','.join(args.datasets)}]", f"limit={args.limit}",
                                     f"max_new_tokens={args.max_new_tokens}", f"device={args.device}", *args.eval])
        eval_timing.write_text(json.dumps({"seconds": eval_s}))
    evals = json.loads((eval_dir / "results.json").read_text())["datasets"]
    seconds = json.loads(timing.read_text()).get("seconds", float("nan")) if timing.exists() else float("nan")
    eval_s = json.loads(eval_timing.read_text())["seconds"] if eval_timing.exists() else float("nan")
    summary = summarise(_metrics(train_dir), seconds, evals, eval_s)
    (run_dir / "quality.json").write_text(json.dumps({"plan": plan, **summary}, indent=2))
    print(f"\nquality run: target={args.target} data={args.data} budget={args.budget_min:g} min")
    print(table(summary))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-quality", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target recipe (recipes/target/<name>.yaml)")
    p.add_argument("--data", required=True, help="a dflash-datagen output folder")
    p.add_argument("--budget-min", type=float, required=True, help="training wall-clock budget in minutes")
    p.add_argument("--run-dir", type=Path, default=Path("runs/quality"))
    p.add_argument("--probe-steps", type=int, default=8, help="steps of the timing probe")
    p.add_argument("--warmup-steps", type=int, default=3, help="probe steps left out of the timing (compilation)")
    p.add_argument("--seconds-per-step", type=float, default=None,
                   help="skip the probe: seconds per step (e.g. from python -m dflash_train.bench)")
    p.add_argument("--startup-s", type=float, default=0.0, help="with --seconds-per-step: start-up seconds")
    p.add_argument("--val-rows", type=int, default=64, help="held-out conversations (held-out expected tau)")
    p.add_argument("--datasets", type=lambda s: s.split(","), default=list(DATASETS))
    p.add_argument("--limit", type=int, default=40, help="first N prompts per eval dataset")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--device", default=None, help="dflash-eval device (default: cuda when a GPU is there, else cpu)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override for both dflash-train and dflash-eval (repeatable)")
    p.add_argument("--eval", nargs="*", default=[], metavar="KEY=VALUE", help="dflash-eval overrides")
    p.add_argument("train", nargs="*", metavar="KEY=VALUE", help="after --: dflash-train overrides")
    p.set_defaults(machine=[])  # machine_defaults, once the machine is known
    return p


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> None:
    run_command("dflash-quality", _run, argv)


if __name__ == "__main__":
    main()
