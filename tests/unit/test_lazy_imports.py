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
# Runs MODULE.main(ARGS), then prints the exit code and whether torch and transformers were imported.
PROBE = """
import json, sys
from {module} import main
try:
    main({args!r})
    code = 0
except SystemExit as stop:
    code = stop.code
print(json.dumps({{"code": code, "torch": "torch" in sys.modules,
                  "transformers": "transformers" in sys.modules}}))
"""


def run_main(module: str, args: list[str], cwd: Path) -> tuple[dict, str]:
    """(what the probe printed, the command's stderr) of ``module``'s main(args)."""
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
COMMANDS = {"dflash-train": "dflash_train.train", "dflash-export": "dflash_train.export.cli"}
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
