"""dflash-quality's plan counts the whole train stage: start-up, steps, validations,
checkpoints and the export; its probe times each of them; the stage ends within the budget."""

import importlib
import json
import subprocess
import types

import pytest

import dflash_train.training.logging as metrics_logging
from dflash_train import quality
from dflash_train.model.target import load_tokenizer
from dflash_train.quality import Schedule, StageCosts
from dflash_train.training.trainer import Trainer
from tests.conftest import SMOLLM2
from tests.train_data import save_tiny_target, write_datagen_dir
from tests.unit.test_quality import REQUIRED, TINY_TRAIN

# A stage of 3 s start-up, 1 s steps, 2 s validations, 1 s checkpoints and a 2 s export.
COSTS = StageCosts(per_step=1.0, startup=3.0, validation=2.0, checkpoint=1.0, export=2.0)
OURS = Schedule(val_every=0, held_out=True, checkpoint_every=None)  # validate at the end, checkpoint by the plan


def train_list(overrides: list[str]) -> str:
    """train=[...] with each override quoted, as Hydra wants."""
    return f"train=[{','.join(json.dumps(o) for o in overrides)}]"


def test_the_schedule_counts_what_the_trainer_does():
    every_4 = Schedule(val_every=4, held_out=True, checkpoint_every=7)
    assert [every_4.validations(n) for n in (3, 4, 8, 10)] == [1, 1, 2, 3]  # each 4th step and the last
    assert [every_4.checkpoints(n) for n in (1, 7, 8, 20)] == [1, 1, 2, 3]  # steps 7, 14 before the last, the final
    assert Schedule(val_every=4, held_out=False, checkpoint_every=0).validations(10) == 0
    assert Schedule(val_every=0, held_out=True, checkpoint_every=0).checkpoints(500) == 1
    # The plan's interval: ceil(steps / 10), the final save included, never more than 10 saves.
    assert [OURS.checkpoints(n) for n in (1, 5, 10, 11, 25, 100, 101)] == [1, 5, 10, 6, 9, 10, 10]
    assert [quality.checkpoint_interval(n) for n in (1, 10, 11, 100, 101)] == [1, 1, 2, 10, 11]
    assert all(OURS.checkpoints(n) <= OURS.most_checkpoints(n) <= OURS.most_checkpoints(n + 1) for n in range(1, 500))


def test_the_plan_subtracts_every_part_before_choosing_the_steps():
    assert quality.plan_steps(20 * 60, StageCosts(0.5, 60.0), Schedule(0, False, 0)) == 2280  # steps only
    assert quality.plan_steps(10, StageCosts(5.0, 60.0), Schedule(0, False, 0)) == 1  # never zero steps
    # 18 s: 3 + n + 2 + min(n, 10) + 2 <= 18 gives 5 steps, each checkpointed (the last by the final save)
    steps = quality.plan_steps(18.0, COSTS, OURS)
    assert steps == 5
    assert quality.stage_parts(steps, COSTS, OURS, OURS.checkpoints(steps)) == {
        "startup": 3.0, "steps": 5.0, "validations": 2.0, "checkpoints": 5.0, "export": 2.0}
    # Longer budgets: about ten checkpoints, validations every val_every steps, all within the budget.
    for budget in (60.0, 300.0, 1200.0, 7200.0):
        for schedule in (OURS, Schedule(val_every=25, held_out=True, checkpoint_every=None),
                         Schedule(val_every=0, held_out=True, checkpoint_every=3)):
            n = quality.plan_steps(budget, COSTS, schedule)
            used = sum(quality.stage_parts(n, COSTS, schedule, schedule.checkpoints(n)).values())
            wider = sum(quality.stage_parts(n + 1, COSTS, schedule, schedule.most_checkpoints(n + 1)).values())
            assert used <= budget < wider, (budget, schedule, n)


def test_probe_costs_split_the_probe_into_its_parts():
    # Launched at t=100; 4 s of loading and compiling; 1 s steps; the checkpoint written after
    # step 4 shows in step 5 (0.5 s), the validation of step 6 in step 6 (2 s); then the final
    # save (0.5 s) and the export (3 s) before the probe finished at t=116.
    times = {1: 105.0, 2: 106.0, 3: 107.0, 4: 108.0, 5: 109.5, 6: 112.5}
    lines = [{"step": s, "time": t} for s, t in times.items()]
    assert quality.probe_costs(lines, warmup=1, launched=100.0, finished=116.0) == StageCosts(
        per_step=1.0, startup=4.0, validation=2.0, checkpoint=0.5, export=3.0)
    with pytest.raises(ValueError, match=r"^the probe logged 4 steps; it needs warmup_steps=2 \+ 3$"):
        quality.probe_costs(lines[:4], warmup=2, launched=100.0, finished=116.0)


def test_the_schedule_comes_from_the_train_stages_own_settings():
    assert quality.stage_schedule(quality.load(REQUIRED)) == Schedule(0, True, None)
    run = quality.load([*REQUIRED, "data.val_rows=0", train_list(["checkpoint.every=7", "data.val_every=5"])])
    assert quality.stage_schedule(run) == Schedule(5, False, 7)


def test_the_plan_line_and_an_older_plan():
    plan = {"budget_min": 0.3, "seconds_per_step": 1.0, "startup_s": 3.0, "validation_s": 2.0, "checkpoint_s": 1.0,
            "export_s": 2.0, "steps": 5, "validations": 1, "checkpoints": 5}
    assert quality.plan_line(plan) == ("[plan] 1.000 s per step, 3 s start-up, validations 1 x 2.0 s, "
                                       "checkpoints 5 x 1.0 s, export 2.0 s: 5 steps in 0.3 min")
    older = {"budget_min": 1, "seconds_per_step": 0.5, "startup_s": 0, "steps": 120}  # counted steps only
    assert quality.plan_line(older) == ("[plan] 0.500 s per step, 0 s start-up, validations 0 x 0.0 s, "
                                        "checkpoints 0 x 0.0 s, export 0.0 s: 120 steps in 1 min")


class Clock:
    """time for dflash-quality and the metric lines: moved by what the stages do, not by the machine."""

    def __init__(self):
        self.now = 1000.0

    def time(self) -> float:
        return self.now


def drive(monkeypatch, clock: Clock, load_s: float | list[float], costs: dict[str, float]) -> None:
    """Run each stage in this process (its real code, its own command line), the clock moved
    load_s when a stage starts (a list: the n-th launch its n-th value, the last one after)
    and costs[name] after each call of Trainer.<name>."""
    loads = list(load_s) if isinstance(load_s, list) else [load_s]
    monkeypatch.setattr(quality, "time", types.SimpleNamespace(time=clock.time, perf_counter=clock.time))
    monkeypatch.setattr(metrics_logging, "time", types.SimpleNamespace(time=clock.time))
    for name, seconds in costs.items():
        def timed(self, *args, _real=getattr(Trainer, name), _seconds=seconds):
            out = _real(self, *args)
            clock.now += _seconds
            return out

        monkeypatch.setattr(Trainer, name, timed)

    def run_in_process(command: list[str], env=None) -> subprocess.CompletedProcess:
        clock.now += loads.pop(0) if len(loads) > 1 else loads[0]
        try:
            importlib.import_module(command[2]).main(command[3:])
        except SystemExit as exit_info:
            return subprocess.CompletedProcess(command, exit_info.code or 0)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(quality, "subprocess", types.SimpleNamespace(run=run_in_process))


@pytest.mark.slow
def test_a_budget_with_a_checkpoint_every_step_ends_within_it(tmp_path, monkeypatch):
    """budget_min=0.3 (18 s) on a driven clock: 12 s to start the first stage (the probe: a
    GGUF's conversion, cold compilers), 3 s every later one, 1 s steps, a 2 s validation, 1 s
    checkpoints, a 2 s export. Counting steps alone planned 15 steps, a checkpoint after each:
    37 s; counting the first launch's start-up, 1 step. The probe times each part and the
    start-up again in a second launch, the plan counts them, and the train stage's wall is
    what the plan said, within the budget (tolerance: 1 ms, the metric lines' rounding)."""
    tok = load_tokenizer(SMOLLM2)
    target = save_tiny_target(tmp_path / "target", tok)
    data = write_datagen_dir(tmp_path / "data", target, tok, repeat=4)
    run = tmp_path / "run"
    clock = Clock()
    drive(monkeypatch, clock, load_s=[12.0, 3.0], costs={"train_step": 1.0, "validate": 2.0, "save": 1.0, "export": 2.0})
    train = [o for o in TINY_TRAIN if not o.startswith("checkpoint.")]  # the plan's checkpoints
    quality.main(["target=smollm2_135m", f"data.path={data}", "budget_min=0.3", f"run_dir={run}", "probe_steps=4",
                  "warmup_steps=1", "data.val_rows=4", "datasets=[mtbench]", "limit=1", "max_new_tokens=4",
                  "device=cpu", f"target.name={target}", "target.num_layers=6", "target.mask_token_id=16",
                  "target.dtype=float32", train_list(train)])
    plan = json.loads((run / quality.PLAN_FILE).read_text())
    assert {k: plan[k] for k in ("seconds_per_step", "startup_s", "validation_s", "checkpoint_s", "export_s",
                                 "steps", "validations", "checkpoints", "total_s")} == {
        "seconds_per_step": 1.0, "startup_s": 3.0, "validation_s": 2.0, "checkpoint_s": 1.0, "export_s": 2.0,
        "steps": 5, "validations": 1, "checkpoints": 5, "total_s": 17.0}
    assert plan["probe_startup_s"] == 12.0
    assert plan["parts_s"] == {"startup": 3.0, "steps": 5.0, "validations": 2.0, "checkpoints": 5.0, "export": 2.0}
    wall = json.loads((run / "train_seconds.json").read_text())["seconds"]
    assert wall == pytest.approx(plan["total_s"], abs=1e-3) and wall <= 0.3 * 60 + 1e-3
    lines = [json.loads(x) for x in (run / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "val_expected_tau" in m] == [5]
    assert json.loads((run / "quality.json").read_text())["plan"] == plan
