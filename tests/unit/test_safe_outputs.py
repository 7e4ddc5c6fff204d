"""Outputs never destroy what the user owns, and an unwritable place fails before any work:
dflash-export out=DIR, the trainer's output_dir and <output_dir>/export, dflash-datagen's
out_dir/data, dflash-eval's output_dir and dflash-quality's run_dir, each through its real
console command, all under one rule: a folder holding files the command did not write is
refused in one line."""

import json
import re
import shutil

import pytest

from dflash_train.errors import check_writable_dir
from dflash_train.model.io import check_export_destination
from dflash_train.model.target import load_tokenizer
from dflash_train.training.trainer import Trainer
from tests.cli_helpers import assert_one_line_error, full_disk, read_only_dir, run_cli, snapshot
from tests.conftest import SMOLLM2
from tests.train_data import tiny_inputs, tiny_train_args, tiny_train_config, write_datagen_dir


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished tiny training run (checkpoint + export)."""
    tiny = tiny_inputs(tmp_path_factory.mktemp("safe"))
    out = tiny["root"] / "run"
    Trainer(tiny_train_config(tiny["target"], tiny["data"], out, max_steps=1, export=True)).fit()
    return {"out": out, "target": tiny["target"], "data": tiny["data"]}


def _user_folder(path):
    path.mkdir(parents=True)
    (path / "thesis.txt").write_text("keep me\n")
    (path / "notes").mkdir()
    (path / "notes" / "a.md").write_bytes(b"\x00\x01 binary too")
    return snapshot(path)


def test_export_into_a_users_folder_is_refused_and_changes_nothing(run, tmp_path):
    mine = tmp_path / "mydocs"
    before = _user_folder(mine)
    done = run_cli("dflash-export", run["out"], f"out={mine}")
    assert_one_line_error(done, "dflash-export", str(mine), "holds files dflash-export did not write", "thesis.txt")
    assert snapshot(mine) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mydocs"]  # no temp or backup folder left


def test_export_over_a_previous_export_replaces_it(run, tmp_path):
    done = run_cli("dflash-export", run["out"], f"out={tmp_path / 'exp'}")
    assert done.returncode == 0, done.stderr
    first = snapshot(tmp_path / "exp")
    done = run_cli("dflash-export", run["out"], f"out={tmp_path / 'exp'}")
    assert done.returncode == 0, done.stderr
    assert snapshot(tmp_path / "exp") == first
    # ... but not once a foreign file sits in it
    (tmp_path / "exp" / "results.csv").write_text("a,b\n")
    before = snapshot(tmp_path / "exp")
    assert_one_line_error(run_cli("dflash-export", run["out"], f"out={tmp_path / 'exp'}"), "dflash-export",
                          "results.csv")
    assert snapshot(tmp_path / "exp") == before


def test_export_destination_rules(run, tmp_path):
    check_export_destination(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    check_export_destination(tmp_path / "empty")
    check_export_destination(run["out"] / "export")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="exists and is not a folder"):
        check_export_destination(tmp_path / "file")
    fake = tmp_path / "fake"  # the right file names, but not our config
    fake.mkdir()
    for name in ("config.json", "model.safetensors", "dflash.py"):
        (fake / name).write_text("{}")
    with pytest.raises(ValueError, match="holds files dflash-export did not write"):
        check_export_destination(fake)


def test_training_refuses_a_users_export_folder_before_training(run, tmp_path):
    out = tmp_path / "run2"
    before = _user_folder(out / "export")
    cfg = tiny_train_config(run["target"], run["data"], out, max_steps=1, export=True)
    with pytest.raises(ValueError, match=r"output_dir .* holds files dflash-train did not write \(export\)"):
        Trainer(cfg)
    assert snapshot(out / "export") == before
    assert not (out / "checkpoints").exists()


def test_training_into_a_file_fails_at_once(run, tmp_path):
    (tmp_path / "afile").write_text("mine")
    done = run_cli("dflash-train", f"target.name={run['target']}", "target.num_layers=6", "target.mask_token_id=16",
                   f"data.path={run['data']}", f"output_dir={tmp_path / 'afile' / 'run'}",
                   "logging.wandb=disabled", "drafter.compile=false")
    assert_one_line_error(done, "dflash-train", str(tmp_path / "afile"), "is a file, not a folder")
    assert (tmp_path / "afile").read_text() == "mine"


def _datagen(out_dir, prompts, *extra):
    return run_cli("dflash-datagen", f"out_dir={out_dir}", "exclude_eval=[]",
                   f"sources=[{{kind: jsonl, path: {prompts}}}]", "sampling.max_new_tokens=2", *extra)


def test_datagen_never_removes_a_users_data_folder(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    out = tmp_path / "P"
    (out / "data").mkdir(parents=True)
    (out / "data" / "results.csv").write_text("step,loss\n1,2.0\n")
    before = snapshot(out)
    done = _datagen(out, prompts)
    assert_one_line_error(done, "dflash-datagen", str(out), "data/results.csv")
    assert snapshot(out) == before


def test_datagen_refuses_a_foreign_dataset_folder_even_beside_a_manifest(run, tmp_path):
    out = tmp_path / "P"
    write_datagen_dir(out, run["target"], load_tokenizer(SMOLLM2))
    (out / "data" / "my_notes.txt").write_text("x")
    before = snapshot(out)
    assert_one_line_error(_datagen(out, tmp_path / "unused.jsonl"), "dflash-datagen", "data/my_notes.txt")
    assert snapshot(out) == before


def test_datagen_out_dir_under_a_file(tmp_path):
    (tmp_path / "f").write_text("mine")
    done = _datagen(tmp_path / "f" / "out", tmp_path / "unused.jsonl")
    assert_one_line_error(done, "dflash-datagen", "is a file, not a folder")


def test_eval_output_dir_that_cannot_be_written_fails_before_evaluating(tmp_path):
    with read_only_dir(tmp_path / "ro") as ro:
        done = run_cli("dflash-eval", "drafter_path=random", f"output_dir={ro / 'results'}", "limit=1",
                       "max_new_tokens=2")
        assert_one_line_error(done, "dflash-eval", str(ro / "results"), "cannot be written")
    assert "mtbench" not in done.stdout  # no table: nothing was evaluated


def test_a_read_only_training_output_dir_fails_before_loading(run, tmp_path):
    with read_only_dir(tmp_path / "ro") as ro:
        cfg = tiny_train_config(run["target"], run["data"], ro / "run", max_steps=1)
        with pytest.raises(ValueError, match="output_dir .* cannot be written"):
            Trainer(cfg)


def test_a_full_disk_is_refused_before_work(tmp_path):
    with full_disk(tmp_path / "full") as full:
        with pytest.raises(ValueError, match=r"only 0 MiB free on its disk, 16 MiB needed"):
            check_writable_dir(full / "out", "out_dir")


def _rule(prog: str, what: str, folder, shown: str) -> str:
    """The one line every command gives for a folder of the user's (errors.check_own_folder)."""
    return (f"{prog}: error: {what} {str(folder)!r} holds files {prog} did not write ({shown}); they are left "
            "untouched: choose an empty or new folder")


def test_every_command_refuses_a_users_folder_with_the_same_rule(run, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    commands = {
        "dflash-train": ("output_dir", lambda d: ["--config-name", "train_quickstart", f"output_dir={d}",
                                                  "logging.wandb=disabled"]),
        "dflash-eval": ("output_dir", lambda d: ["drafter_path=random", f"output_dir={d}", "limit=1"]),
        "dflash-export": ("export directory", lambda d: [run["out"], f"out={d}"]),
        "dflash-datagen": ("out_dir", lambda d: [f"out_dir={d}", "exclude_eval=[]",
                                                 f"sources=[{{kind: jsonl, path: {prompts}}}]"]),
        "dflash-quality": ("run_dir", lambda d: ["target=smollm2_135m", f"data.path={run['data']}", "budget_min=1",
                                                 f"run_dir={d}"]),
    }
    for prog, (what, args) in commands.items():
        mine = tmp_path / prog
        mine.mkdir()
        (mine / "thesis.txt").write_text("keep me\n")
        done = run_cli(prog, *args(mine))
        line = assert_one_line_error(done, prog)
        assert line == _rule(prog, what, mine, "thesis.txt"), line
        assert snapshot(mine) == {"thesis.txt": b"keep me\n"}, prog


def test_training_keeps_a_users_metrics_and_manifest(run, tmp_path):
    """Training's own file names in a folder it did not create are the user's: their
    metrics.jsonl and data_manifest.json, beside their other files, stay as they are."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.txt").write_text("keep me\n")
    (out / "sub").mkdir()
    (out / "sub" / "notes.md").write_text("x")
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    (out / "data_manifest.json").write_text('{"mine": true}\n')
    before = snapshot(out)
    args = tiny_train_args(run["target"], run["data"], out, "max_steps=1")
    assert_one_line_error(run_cli("dflash-train", *args), "dflash-train",
                          "holds files dflash-train did not write (thesis.txt, sub/notes.md, "
                          "data_manifest.json and 1 more)")
    (out / "thesis.txt").unlink()
    shutil.rmtree(out / "sub")
    before = snapshot(out)  # only names training also writes, but no run.json of a run of ours
    line = assert_one_line_error(run_cli("dflash-train", *args), "dflash-train")
    assert line == _rule("dflash-train", "output_dir", out, "data_manifest.json, metrics.jsonl")
    assert snapshot(out) == before
    # A run's own folder is still continued: run.json says it is ours.
    done = run_cli("dflash-train", *tiny_train_args(run["target"], run["data"], tmp_path / "new", "max_steps=1"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((tmp_path / "new" / "run.json").read_text()) == {"written_by": "dflash-train"}
    done = run_cli("dflash-train", *tiny_train_args(run["target"], run["data"], tmp_path / "new", "max_steps=2"))
    assert done.returncode == 0, done.stderr[-2000:]
    steps = [json.loads(x)["step"] for x in (tmp_path / "new" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


def test_eval_keeps_a_users_results_json(tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    (out / "results.json").write_text('{"accuracy": 0.93}\n')
    done = run_cli("dflash-eval", "drafter_path=random", f"output_dir={out}", "limit=1", "max_new_tokens=2")
    line = assert_one_line_error(done, "dflash-eval")
    assert line == _rule("dflash-eval", "output_dir", out, "results.json")
    assert snapshot(out) == {"results.json": b'{"accuracy": 0.93}\n'}
    assert not re.search(r"mtbench\s+\d", done.stdout)  # nothing was evaluated
