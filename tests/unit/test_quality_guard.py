"""The quality guard's verdict: the mean over seeds of (measured - reference) of the same seed
may fall by at most 2 * sd * sqrt(2 / n) at each pinned step (sd: the pinned seed-to-seed
standard deviation of that step), the median step may slow by at most 3%, and step times are
compared only on the pinned device for runs that had the GPU to themselves."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

GUARD = Path(__file__).resolve().parents[2] / "benchmarks" / "quality_guard.py"


@pytest.fixture(scope="module")
def guard():
    spec = importlib.util.spec_from_file_location("quality_guard", GUARD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def metric_lines(step_s: float, taus: dict[int, float], slow_val_s: float = 9.0) -> list[dict]:
    """Metric lines like dflash-train's: one every 10 steps, a validation every 150 (slower interval)."""
    lines, t = [], 1000.0
    for step in range(10, 610, 10):
        t += 10 * step_s + (slow_val_s if step in taus else 0.0)
        line = {"step": step, "time": t, "loss": 1.0}
        if step in taus:
            line["val_expected_tau"] = taus[step]
        lines.append(line)
    return lines


SD = {"150": 0.03, "300": 0.02, "450": 0.02, "600": 0.01}
PINNED = {"seeds": {"0": {"150": 1.10, "300": 1.26, "450": 1.34, "600": 1.37},
                    "1": {"150": 1.11, "300": 1.23, "450": 1.30, "600": 1.32},
                    "2": {"150": 1.08, "300": 1.23, "450": 1.32, "600": 1.35}},
          "seed_sd": SD, "median_step_s": 0.2, "parallel": 1, "device": "H100", "commit": "abc"}


def runs(shift: dict[str, float], seeds=("0",), step_s: float = 0.2) -> dict[int, list[dict]]:
    """Metric lines of each seed: the pinned taus moved by ``shift`` (step -> change)."""
    return {int(s): metric_lines(step_s, {int(k): v + shift.get(k, 0.0) for k, v in PINNED["seeds"][s].items()})
            for s in seeds}


def test_median_step_ignores_validations_and_warmup(guard):
    lines = metric_lines(0.2, {150: 1.1, 300: 1.2, 450: 1.3, 600: 1.4})
    lines[0]["time"] -= 60.0  # a compile-heavy first interval: warm-up lines are skipped
    assert guard.median_step_seconds(lines) == pytest.approx(0.2)
    assert guard.held_out_tau(lines) == {150: 1.1, 300: 1.2, 450: 1.3, 600: 1.4}


def test_threshold_shrinks_with_seeds(guard):
    assert guard.threshold(0.01, 1) == pytest.approx(2 * 0.01 * math.sqrt(2))
    assert guard.threshold(0.01, 3) == pytest.approx(2 * 0.01 * math.sqrt(2 / 3))


@pytest.mark.parametrize("shift, seeds, step_s, device, ok", [
    ({}, ("0",), 0.2, "H100", True),                                   # the pin itself
    ({"600": -0.028}, ("0",), 0.205, "H100", True),                     # within 2 * 0.01 * sqrt(2) = 0.0283
    ({"600": -0.029}, ("0",), 0.2, "H100", False),                      # beyond it
    ({"600": -0.020}, ("0", "1", "2"), 0.2, "H100", False),             # 3 seeds: 0.0163 is the limit
    ({"150": -0.080}, ("0",), 0.2, "H100", True),                       # step 150 is noisier (sd 0.03)
    ({}, ("0",), 0.207, "H100", False),                                  # 3.5% slower
    ({}, ("0",), 0.3, "H200", True),                                     # other device: time not compared
])
def test_verdict(guard, shift, seeds, step_s, device, ok):
    measured = guard.measure(runs(shift, seeds, step_s), device, "def")
    rows, verdict = guard.judge(measured, PINNED, SD)
    assert verdict is ok
    assert len(rows) == 5
    assert sum("FAIL" in r for r in rows) == (0 if ok else 1)


def test_a_missing_step_or_seed_fails(guard):
    lines = runs({})
    lines[0] = [m for m in lines[0] if m.get("val_expected_tau") is None or m["step"] != 450]
    rows, ok = guard.judge(guard.measure(lines, "H100", "def"), PINNED, SD)
    assert not ok and "| held-out tau @ 450 | - | missing |" in rows[2]
    other = {"seeds": {"7": PINNED["seeds"]["0"]}, "median_step_s": 0.2, "device": "H100"}
    assert guard.judge(other, PINNED, SD)[1] is False


def test_runs_sharing_the_gpu_are_not_timed(guard):
    rows, ok = guard.judge(guard.measure(runs({}, step_s=0.5), "H100", "def", parallel=3), PINNED, SD)
    assert ok and "not compared: runs shared the GPU" in rows[-1]


def test_pooled_sd_removes_each_arms_mean(guard):
    # Two arms, far apart in mean, each with a spread of sd 0.01 at step 600.
    a = {"0": {"600": 1.30}, "1": {"600": 1.31}, "2": {"600": 1.32}}
    b = {"0": {"600": 1.40}, "1": {"600": 1.41}, "2": {"600": 1.42}}
    assert guard.pooled_sd([a, b]) == {"600": 0.01}


def write_seed_runs(folder: Path, seed_runs: dict[int, list[dict]]) -> None:
    for seed, lines in seed_runs.items():
        (folder / f"seed-{seed}").mkdir(parents=True)
        (folder / f"seed-{seed}" / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in lines))


def test_judges_finished_runs_from_the_command_line(guard, tmp_path, capsys):
    write_seed_runs(tmp_path / "new", runs({"150": -0.2}, ("0", "1")))
    pinned = tmp_path / "pinned.json"
    pinned.write_text(json.dumps(PINNED))
    written = tmp_path / "new.json"
    assert guard.main(["--metrics", str(tmp_path / "new"), "--pinned", str(pinned),
                       "--write-pinned", str(written)]) == 1
    out = capsys.readouterr().out
    assert "| held-out tau @ 150 | 1.105 | 0.905 | -0.200 | -0.060 | FAIL |" in out and out.rstrip().endswith("FAIL")
    assert json.loads(written.read_text())["seeds"]["1"]["150"] == pytest.approx(0.91)


def test_a_paired_ab_against_a_baseline(guard, tmp_path, capsys):
    """--baseline: the reference is another finished set, seed by seed (here 0.05 above the pin)."""
    write_seed_runs(tmp_path / "base", runs({"600": 0.05}, ("0", "1", "2")))
    write_seed_runs(tmp_path / "new", runs({}, ("0", "1", "2")))
    pinned = tmp_path / "pinned.json"
    pinned.write_text(json.dumps(PINNED))
    args = ["--metrics", str(tmp_path / "new"), "--pinned", str(pinned)]
    assert guard.main(args) == 0
    assert guard.main([*args, "--baseline", str(tmp_path / "base")]) == 1
    assert "| held-out tau @ 600 | 1.397 | 1.347 | -0.050 | -0.016 | FAIL |" in capsys.readouterr().out


def with_block_tau(seed_runs: dict[int, list[dict]], shift: float) -> dict[int, list[dict]]:
    """The runs with a held-out tau counted block by block at each validation: expected + shift."""
    for lines in seed_runs.values():
        for m in lines:
            if "val_expected_tau" in m:
                m["val_tau"] = m["val_expected_tau"] + shift
    return seed_runs


def test_the_block_by_block_tau_is_reported_and_never_judged(guard, tmp_path, capsys):
    measured = guard.measure(with_block_tau(runs({}, ("0", "1")), 0.5), "H100", "def")
    assert measured["block_tau"]["1"]["600"] == pytest.approx(1.82)
    rows, ok = guard.judge(measured, PINNED, SD)
    assert ok and not any("blocks" in r for r in rows)  # the verdict is the expected tau's alone
    # against the pin, which holds none: the measured mean of seeds 0 and 1 only
    assert guard.reported_rows(measured, PINNED)[-1] == "| held-out tau (blocks) @ 600 | - | 1.845 | - | - | reported |"
    # a paired A/B: a fall of 0.3 in the block-by-block tau is shown, and the verdict stays PASS
    write_seed_runs(tmp_path / "base", with_block_tau(runs({}, ("0", "1")), 0.5))
    write_seed_runs(tmp_path / "new", with_block_tau(runs({}, ("0", "1")), 0.2))
    pinned = tmp_path / "pinned.json"
    pinned.write_text(json.dumps(PINNED))
    assert guard.main(["--metrics", str(tmp_path / "new"), "--pinned", str(pinned),
                       "--baseline", str(tmp_path / "base")]) == 0
    out = capsys.readouterr().out
    assert "| held-out tau (blocks) @ 150 | 1.605 | 1.305 | -0.300 | - | reported |" in out
    assert out.rstrip().endswith("PASS")


def test_the_pinned_figures_cover_the_arm(guard):
    pinned = json.loads(guard.PINNED.read_text())
    assert sorted(pinned["seeds"]) == ["0", "1", "2"]
    assert all(sorted(map(int, taus)) == [150, 300, 450, 600] for taus in pinned["seeds"].values())
    assert sorted(map(int, pinned["seed_sd"])) == [150, 300, 450, 600]


def test_a_failed_seed_shows_its_log_and_the_others_run_on(guard, tmp_path, capsys):
    """Seeds run as real dflash-train processes; one refused (a drafter kind that does not exist)
    ends the guard with every failed seed named, each log's last lines printed, and the others'
    folders kept."""
    data = tmp_path / "none"
    with pytest.raises(SystemExit) as end:
        guard.main(["--target", "smollm2", "--data", str(data), "--out", str(tmp_path / "g"),
                    "--seeds", "0", "1", "--parallel", "2", "drafter.kind=dflash9"])
    assert str(end.value).startswith("quality guard: seed 0 failed (exit 2), see ")
    assert "seed 1 failed (exit 2)" in str(end.value)
    out = capsys.readouterr().out
    assert out.count("its log's last lines:") == 2
    assert out.count("    dflash-train: error: drafter.kind='dflash9'; expected one of") == 2  # each seed's tail


def test_log_tail_splits_progress_bars_and_cuts_lines(guard, tmp_path):
    log = tmp_path / "seed-0.log"
    log.write_text("start\n" + "\r".join(f"bar {i}%" for i in range(5)) + "\n" + "x" * 500 + "\nerror: boom\n")
    assert guard.log_tail(log, lines=3, width=10).splitlines() == ["    bar 4%", "    xxxxxxxxxx", "    error: boo"]


def test_the_commit_comes_from_the_environment_where_there_is_no_git(guard, tmp_path, monkeypatch):
    """A lease's copy of the checkout has no .git: the guard says the commit setup.sh exported
    (DFLASH_COMMIT, the wheel's), not None; inside the repository git's HEAD wins."""
    monkeypatch.setenv("DFLASH_COMMIT", "033addf+dirty")
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert guard._git_commit() == "033addf+dirty"
    monkeypatch.delenv("DFLASH_COMMIT")
    assert guard._git_commit() is None
    monkeypatch.chdir(GUARD.parents[1])
    monkeypatch.setenv("DFLASH_COMMIT", "not-this")
    head = guard._git_commit()
    assert head and head != "not-this" and len(head.split("+")[0]) >= 7
