"""Paths with spaces and non-ASCII letters work as typed on the command line, in every
command and between the stages of dflash-quality (which quotes what it passes on)."""

import json

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from dflash_train import quality
from dflash_train.recipe import parse_command_line, quote_value
from tests.cli_helpers import run_cli, warm_stages
from tests.train_data import tiny_inputs, tiny_train_args
from tests.unit.test_quality import TINY_TRAIN

ODD = "Übungs läufe/模型 ñ"  # spaces, accented and CJK letters


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_inputs(tmp_path_factory.mktemp("paths") / ODD)


@pytest.mark.parametrize("value", ["/data/Übungs läufe/模型", "/a b/c", "it's", "c:\\runs\\", "x,y", "(a)", "plain/x"])
def test_a_quoted_value_reads_back_as_written(value):
    assert OverridesParser.create().parse_override(f"k={quote_value(value)}").value() == value


def test_a_value_hydra_cannot_read_is_quoted_for_it():
    line = parse_command_line(["data.path=/data/Übungs läufe/模型", "output_dir=/a b", "datasets=[a,b]",
                               "train=optim.lr=1e-3", "seed=1"], "train", "")
    assert line.overrides == ["data.path='/data/Übungs läufe/模型'", "output_dir=/a b", "datasets=[a,b]",
                              "train=optim.lr=1e-3", "seed=1"]


def test_training_reads_and_writes_such_paths(tiny, tmp_path):
    run = tmp_path / ODD / "rün 1"
    done = run_cli("dflash-train", *tiny_train_args(tiny["target"], tiny["data"], run, "max_steps=2", "export=true"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (run / "export" / "model.safetensors").is_file()
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_quality_passes_such_paths_to_its_stages(tiny, tmp_path, monkeypatch):
    warm_stages(monkeypatch, quality)
    run = tmp_path / ODD / "qualität 1"
    argv = ["target=smollm2_135m", f"data.path={tiny['data']}", "budget_min=0.05", "seconds_per_step=1",
            f"run_dir={run}", "data.val_rows=2", "datasets=[mtbench]", "limit=1", "max_new_tokens=4", "device=cpu",
            f"target.name={tiny['target']}", "target.num_layers=6", "target.mask_token_id=16", "target.dtype=float32",
            f"train=[{','.join(json.dumps(o) for o in TINY_TRAIN)}]"]
    quality.main(argv)
    out = json.loads((run / "quality.json").read_text())
    assert out["steps"] == out["plan"]["steps"] == 3
    assert (run / "train" / "export" / "model.safetensors").is_file()
    assert json.loads((run / "eval" / "results.json").read_text())["drafter"] == str(run / "train" / "export")
