"""A command refuses bad input before it imports torch or transformers: the real command's
main() runs in a fresh interpreter, and the modules it loaded are read after its exit."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_train.data.format import FORMAT_VERSION

ROOT = Path(__file__).resolve().parents[2]
# Runs MODULE as ``python -m MODULE ARGS`` does, then prints the exit code and whether torch
# and transformers were imported.
PROBE = """
import json, runpy, sys
sys.argv = [{module!r}, *{args!r}]
try:
    runpy.run_module({module!r}, run_name="__main__", alter_sys=True)
    code = 0
except SystemExit as stop:
    code = stop.code
print(json.dumps({{"code": code, "torch": "torch" in sys.modules,
                  "transformers": "transformers" in sys.modules}}))
"""


def run_main(module: str, args: list[str], cwd: Path) -> tuple[dict, str]:
    """(what the probe printed, the command's stderr) of ``python -m module args``."""
    done = subprocess.run([sys.executable, "-c", PROBE.format(module=module, args=args)], cwd=cwd,
                          capture_output=True, text=True, timeout=120, env=_env(), check=False)
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _users_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("the user's\n")
    return folder


# (command, its module): the commands whose settings are refused before torch is imported.
COMMANDS = {"dflash-train": "dflash_train.train", "dflash-export": "dflash_train.export.cli",
            "dflash-datagen": "data_gen.cli", "dflash-eval": "dflash_train.eval.cli",
            "dflash-speed": "dflash_train.eval.speed", "dflash-bench": "dflash_train.bench",
            "dflash-quality": "dflash_train.quality"}
TRAIN_REFUSALS = {
    "unknown key": (["optim.lrr=1", "data.path=d", "output_dir=o"], "unknown key optim.lrr (did you mean optim.lr?)"),
    "missing output_dir": (["data.path=d"], "missing value for output_dir: add output_dir=<run folder> to the command"),
    "wrong type": (["optim.lr=fast", "data.path=d", "output_dir=o"], "wrong type for optim.lr='fast'"),
    "missing data": (["data.path=/nonexistent", "output_dir=o"],
                     "'/nonexistent' has no manifest.json: not a dflash-datagen output"),
    "user's output_dir": (["data.path=/nonexistent", "output_dir=mine"], "holds files dflash-train did not write (notes.txt)"),
}


EXPORT_REFUSALS = {
    "unknown key": (["runs/x", "outt=y"], "unknown key outt (did you mean out?)"),
    "missing path": (["out=y"], "missing value for path: add path=<run output_dir or checkpoint directory> to the command"),
    "retired flag": (["runs/x", "--push"], "--push"),
    "wrong type": (["runs/x", "push=maybe"], "push='maybe'"),
}


@pytest.mark.parametrize("case", sorted(TRAIN_REFUSALS))
def test_train_refuses_before_importing_torch(tmp_path, case):
    _users_folder(tmp_path)
    args, message = TRAIN_REFUSALS[case]
    assert_refused_without_torch("dflash-train", args, message, tmp_path)
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]


@pytest.mark.parametrize("case", sorted(EXPORT_REFUSALS))
def test_export_refuses_settings_before_importing_torch(tmp_path, case):
    args, message = EXPORT_REFUSALS[case]
    assert_refused_without_torch("dflash-export", args, message, tmp_path)


def assert_refused_without_torch(prog: str, args: list[str], message: str, cwd: Path) -> None:
    """``prog`` refuses ``args`` in one line holding ``message``, exit 2, having imported neither
    torch nor transformers and written nothing in ``cwd``."""
    before = sorted(p.name for p in cwd.iterdir())
    seen, err = run_main(COMMANDS[prog], args, cwd)
    assert seen == {"code": 2, "torch": False, "transformers": False}
    assert err.startswith(f"{prog}: error: ") and message in err and err.count("\n") == 1
    assert sorted(p.name for p in cwd.iterdir()) == before  # nothing written, no folder made


def test_train_imports_torch_once_the_checks_pass(tmp_path):
    """The control: inputs that pass the early checks reach the trainer, which imports torch
    (and here refuses the target, which does not exist)."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "manifest.json").write_text(json.dumps({"format_version": FORMAT_VERSION}))
    args = [f"data.path={data}", "output_dir=run", "target.name=/nonexistent-target", "backend=single",
            "backend.device=cpu"]
    seen, err = run_main("dflash_train.train", args, tmp_path)
    assert seen["code"] == 2 and seen["torch"] is True
    assert err.startswith("dflash-train: error: ") and "/nonexistent-target" in err


def _dataset(tmp_path: Path) -> Path:
    """A folder that passes the early checks of a dflash-datagen output (its manifest)."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "manifest.json").write_text(json.dumps({"format_version": FORMAT_VERSION}))
    return data


DATAGEN_REFUSALS = {
    "unknown key": (["out_dir=o", "sampling.top_pp=1"], "unknown key sampling.top_pp (did you mean sampling.top_p?)"),
    "missing out_dir": ([], "missing value for out_dir: add out_dir=<new or empty folder> to the command"),
    "bad number": (["out_dir=o", "sampling.top_p=2"], "sampling.top_p=2.0: must be in (0, 1]"),
    "bad budget": (["out_dir=o", "budget_min=0"], "budget_min=0: must be a positive number of minutes or null"),
    "user's out_dir": (["out_dir=mine"], "out_dir 'mine' holds files dflash-datagen did not write (notes.txt)"),
    "missing source file": (["out_dir=o", "sources=[{kind:jsonl,path:/nonexistent.jsonl}]"],
                            "source 'jsonl': no such file '/nonexistent.jsonl'"),
}
EVAL_REFUSALS = {
    "unknown key": (["drafter_path=random", "limt=3"], "unknown key limt (did you mean limit?)"),
    "bad number": (["drafter_path=random", "max_new_tokens=0"], "max_new_tokens must be >= 1, got 0"),
    "bad temperature": (["drafter_path=random", "temperature=-1"], "temperature=-1 must be a finite number >= 0"),
    "verify_tokens past the block": (["drafter_path=random", "verify_tokens=16"],
                                     "verify_tokens=16: must be an integer in 1..15 (the drafts of a block of 16)"),
    "no drafter folder": (["drafter_path=/nonexistent"], "drafter_path '/nonexistent' is not a directory"),
    "a folder that is no drafter": (["drafter_path=mine"], "mine: no config.json; not a DFlash drafter export"),
    "user's output_dir": (["drafter_path=random", "output_dir=mine"],
                          "output_dir 'mine' holds files dflash-eval did not write (notes.txt)"),
    "unknown dataset": (["drafter_path=random", "datasets=[mtbenchh]"], "unknown dataset 'mtbenchh': use one of"),
    "missing dataset file": (["drafter_path=random", "datasets=[/nonexistent.jsonl]"],
                             "dataset '/nonexistent.jsonl': no such file"),
}
SPEED_REFUSALS = {
    "verify_tokens past the block": (["drafter_path=random", "drafter=b8", "verify_tokens=8"],
                                     "verify_tokens=8: must be an integer in 1..7 (the drafts of a block of 8)"),
    "step_timing without steps": (["drafter_path=random", "step_timing=true", "max_new_tokens=1"],
                                  "step_timing=true needs max_new_tokens >= 2, got 1"),
}
BENCH = ["--config-name", "train_quickstart"]
BENCH_REFUSALS = {
    "unknown key": ([*BENCH, "bench.stepz=3"], "unknown key bench.stepz (did you mean bench.steps?)"),
    "retired flag": ([*BENCH, "--steps", "3"], "--steps is no longer accepted; use bench.steps=N"),
    "bad number": ([*BENCH, "bench.steps=0"], "bench.steps=0 must be >= 1 and bench.warmup=2 >= 0"),
    "layer ids past a random target's": (["bench.random_target=true", "target=qwen3_8b", "bench.target_layers=4",
                                          "drafter.target_layer_ids=[1,5]"], "but the target has 4 layers"),
    "layers without a random target": ([*BENCH, "bench.target_layers=2"],
                                       "bench.target_layers=2 needs bench.random_target=true"),
    "not a dataset": ([*BENCH, "data.path=/nonexistent"], "'/nonexistent' has no manifest.json: not a dflash-datagen output"),
    "user's file as bench.json": ([*BENCH, "bench.json=mine/notes.txt"],
                                  "bench.json=mine/notes.txt exists and is not an earlier dflash-bench json"),
}
QUALITY = ["target=smollm2_135m", "budget_min=5", "data.path=data", "run_dir=run"]
QUALITY_REFUSALS = {
    "unknown key": ([*QUALITY, "budget=3"], "unknown key budget (did you mean budget_min?)"),
    "bad number": ([*QUALITY, "limit=0"], "limit=0 must be a positive number"),
    "user's run_dir": ([*QUALITY, "run_dir=mine"], "run_dir 'mine' holds files dflash-quality did not write (notes.txt)"),
    "not a dataset": ([*QUALITY, "data.path=/nonexistent"],
                      "'/nonexistent' has no manifest.json: not a dflash-datagen output"),
    "unknown dataset": ([*QUALITY, "datasets=[mtbenchh]"], "unknown dataset 'mtbenchh': use one of"),
}
REFUSALS = {"dflash-datagen": DATAGEN_REFUSALS, "dflash-eval": EVAL_REFUSALS, "dflash-speed": SPEED_REFUSALS,
            "dflash-bench": BENCH_REFUSALS, "dflash-quality": QUALITY_REFUSALS}


@pytest.mark.parametrize("prog, case", [(prog, case) for prog, cases in REFUSALS.items() for case in sorted(cases)])
def test_a_command_refuses_bad_input_before_importing_torch(tmp_path, prog, case):
    _users_folder(tmp_path)
    _dataset(tmp_path)
    args, message = REFUSALS[prog][case]
    assert_refused_without_torch(prog, args, message, tmp_path)
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]
    assert [p.name for p in (tmp_path / "data").iterdir()] == ["manifest.json"]


@pytest.mark.parametrize("prog, args", [
    ("dflash-datagen", ["out_dir=o", "target.name=/nonexistent-target", "backend.device=cpu"]),
    ("dflash-eval", ["drafter_path=random", "target.name=/nonexistent-target", "datasets=[mtbench]", "limit=1"]),
    ("dflash-quality", [*QUALITY, "target.name=/nonexistent-target", "seconds_per_step=1"]),
])
def test_inputs_that_pass_the_early_checks_reach_torch(tmp_path, prog, args):
    """The control: the same commands with inputs their early checks pass import torch (and
    here refuse the target, which does not exist; dflash-quality asks torch for a GPU, then
    its train stage refuses it)."""
    _dataset(tmp_path)
    seen, err = run_main(COMMANDS[prog], args, tmp_path)
    assert seen["code"] != 0 and seen["torch"] is True
    assert "/nonexistent-target" in err
