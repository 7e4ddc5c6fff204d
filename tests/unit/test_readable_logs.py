"""Every line a person reads is one line under MAX_LINE characters: a real (tiny) training run's
whole output, progress bars aside, and the helpers that wrap notes and commands."""

from __future__ import annotations

import json
import re
import shlex

import pytest

from dflash_train.console import MAX_LINE, NOTE_WIDTH, command_lines, note_lines
from dflash_train.training.run_dir import INIT_MAP_FILE
from tests.cli_helpers import readable_lines, run_cli
from tests.train_data import tiny_inputs, tiny_train_args

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_inputs(tmp_path_factory.mktemp("tiny"))


def _train(tiny, out, *overrides):
    args = tiny_train_args(tiny["target"], tiny["data"], out, "logging.progress_bar=true",
                           "drafter.init_from_target=true", "data.val_rows=2", "data.val_every=1", "epochs=4",
                           *overrides)
    done = run_cli("dflash-train", *args, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout + done.stderr


def test_a_training_run_prints_no_line_over_the_limit(tiny, tmp_path):
    out = tmp_path / "run"
    first = _train(tiny, out, "max_steps=2", "checkpoint.every=1", "export=true")
    # resumed under changed settings: the changes are listed, one line each
    again = _train(tiny, out, "max_steps=4", "optim.lr=1e-3", "checkpoint.resume=force")
    lines = readable_lines(first) + readable_lines(again)
    assert [line for line in lines if len(line) >= MAX_LINE] == []
    # the copied-weight map is in the run folder, the log line says where
    copied = json.loads((out / INIT_MAP_FILE).read_text())
    assert copied["layers.0.self_attn.q_proj.weight"] == "model.layers.5.self_attn.q_proj.weight"
    assert copied["norm.weight"] == "model.norm.weight"
    said = [line for line in lines if "drafter initialised from" in line]
    assert len(said) == 2 and said[0].endswith(f"target layer 5 and the final norm: {len(copied)} tensors copied "
                                               f"(the map: {out / INIT_MAP_FILE})")
    assert any(line.endswith("  optim.lr: 0.003 -> 0.001") for line in lines)
    assert any(line.startswith("train: 100%") and "4/4" in line for line in re.split(r"[\r\n]", again))  # the bar


def test_a_note_wraps_under_its_width_and_reads_the_same():
    text = " ".join(f"word{i}" for i in range(80))
    lines = note_lines(text)
    assert len(lines) > 1 and all(len(line) <= NOTE_WIDTH for line in lines)
    assert all(line.startswith("    ") for line in lines[1:])
    assert " ".join(line.strip() for line in lines) == text


def test_a_wrapped_command_pastes_back_into_the_same_words():
    words = ["dflash_train.train", *(f"optim.key{i}=value{i}" for i in range(30)), "output_dir=/a/long/path/" + "x" * 120]
    text = command_lines("[train]", words)
    lines = text.splitlines()
    assert len(lines) > 1 and all(line.endswith(" \\") for line in lines[:-1])
    assert all(len(line) <= NOTE_WIDTH for line in lines[:-1])  # only a word longer than the width exceeds it
    assert shlex.split(text.replace(" \\\n", " ")) == ["[train]", *words]
    assert command_lines("[eval]", ["a", "b"]) == "[eval] a b"
