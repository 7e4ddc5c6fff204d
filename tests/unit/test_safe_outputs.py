"""Outputs never destroy what the user owns, and an unwritable place fails before any work:
dflash-export --out, the trainer's <output_dir>/export, dflash-datagen's out_dir/data and
dflash-eval's output_dir, each through its real console command."""

import json

import pytest

from dflash_train.errors import check_writable_dir
from dflash_train.model.io import check_export_destination
from dflash_train.model.target import load_tokenizer
from dflash_train.training.trainer import Trainer
from tests.cli_helpers import assert_one_line_error, full_disk, read_only_dir, run_cli, snapshot
from tests.conftest import SMOLLM2
from tests.train_data import tiny_inputs, tiny_train_config, write_datagen_dir


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
    done = run_cli("dflash-export", run["out"], "--out", mine)
    assert_one_line_error(done, "dflash-export", str(mine), "not a previous export", "thesis.txt")
    assert snapshot(mine) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mydocs"]  # no temp or backup folder left


def test_export_over_a_previous_export_replaces_it(run, tmp_path):
    done = run_cli("dflash-export", run["out"], "--out", tmp_path / "exp")
    assert done.returncode == 0, done.stderr
    first = snapshot(tmp_path / "exp")
    done = run_cli("dflash-export", run["out"], "--out", tmp_path / "exp")
    assert done.returncode == 0, done.stderr
    assert snapshot(tmp_path / "exp") == first
    # ... but not once a foreign file sits in it
    (tmp_path / "exp" / "results.csv").write_text("a,b\n")
    before = snapshot(tmp_path / "exp")
    assert_one_line_error(run_cli("dflash-export", run["out"], "--out", tmp_path / "exp"), "dflash-export",
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
    with pytest.raises(ValueError, match="not a previous export"):
        check_export_destination(fake)


def test_training_refuses_a_users_export_folder_before_training(run, tmp_path):
    out = tmp_path / "run2"
    before = _user_folder(out / "export")
    cfg = tiny_train_config(run["target"], run["data"], out, max_steps=1, export=True)
    with pytest.raises(ValueError, match="export directory .* is not empty and is not a previous export"):
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
