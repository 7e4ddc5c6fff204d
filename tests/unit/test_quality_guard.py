"""The quality guard's verdict: tau may fall by at most 0.01 at any pinned step, the median
step may slow by at most 3%, and step times are compared on the pinned device only."""

import importlib.util
import json
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


PINNED = {"val_expected_tau": {"150": 1.132, "300": 1.287, "450": 1.354, "600": 1.393},
          "median_step_s": 0.2, "device": "H100", "commit": "abc"}


def test_median_step_ignores_validations_and_warmup(guard):
    lines = metric_lines(0.2, {150: 1.1, 300: 1.2, 450: 1.3, 600: 1.4})
    lines[0]["time"] -= 60.0  # a compile-heavy first interval: warm-up lines are skipped
    assert guard.median_step_seconds(lines) == pytest.approx(0.2)
    assert guard.held_out_tau(lines) == {150: 1.1, 300: 1.2, 450: 1.3, 600: 1.4}


@pytest.mark.parametrize("taus, step_s, device, ok", [
    ({150: 1.132, 300: 1.287, 450: 1.354, 600: 1.393}, 0.2, "H100", True),   # identical
    ({150: 1.123, 300: 1.287, 450: 1.354, 600: 1.400}, 0.205, "H100", True),  # -0.009 and +2.5%: within
    ({150: 1.132, 300: 1.287, 450: 1.343, 600: 1.393}, 0.2, "H100", False),   # -0.011 at 450
    ({150: 1.132, 300: 1.287, 450: 1.354, 600: 1.393}, 0.207, "H100", False),  # 3.5% slower
    ({150: 1.132, 300: 1.287, 450: 1.354, 600: 1.393}, 0.3, "H200", True),    # other device: time not compared
    ({150: 1.132, 300: 1.287, 450: 1.354}, 0.2, "H100", False),               # a pinned step missing
])
def test_verdict(guard, taus, step_s, device, ok):
    measured = guard.measure(metric_lines(step_s, taus), device, "def")
    rows, verdict = guard.judge(measured, PINNED)
    assert verdict is ok
    assert len(rows) == 5
    assert sum("FAIL" in r for r in rows) == (0 if ok else 1)


def test_judges_a_finished_run_from_the_command_line(guard, tmp_path, capsys):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps(m) for m in metric_lines(0.2, {150: 1.0, 300: 1.287, 450: 1.354,
                                                                        600: 1.393})))
    pinned = tmp_path / "pinned.json"
    pinned.write_text(json.dumps(PINNED))
    written = tmp_path / "new.json"
    assert guard.main(["--metrics", str(metrics), "--pinned", str(pinned), "--write-pinned", str(written)]) == 1
    out = capsys.readouterr().out
    assert "| held-out tau @ 150 | 1.132 | 1.000 | -0.132 | FAIL |" in out and out.rstrip().endswith("FAIL")
    assert json.loads(written.read_text())["val_expected_tau"]["150"] == 1.0


def test_the_pinned_figures_cover_the_arm(guard):
    pinned = json.loads(guard.PINNED.read_text())
    assert sorted(map(int, pinned["val_expected_tau"])) == [150, 300, 450, 600]
