"""Training data is checked before the first step: a damaged Arrow file fails the checksum
the manifest records, and rows a target cannot use (token ids outside its vocabulary, loss
masks that do not fit their ids) are named in one line with the row, the value and the
vocabulary size; an empty dataset says it is empty."""

import json
import shutil

import datasets
import pyarrow as pa
import pytest

from dflash_train.data import format as data_format
from dflash_train.model.target import load_tokenizer
from dflash_train.training.trainer import Trainer
from tests.cli_helpers import assert_one_line_error, run_cli
from tests.conftest import SMOLLM2
from tests.train_data import (
    CONVERSATIONS,
    chat_row,
    save_tiny_target,
    tiny_train_args,
    tiny_train_config,
    write_datagen_dir,
)

VOCAB = 49152  # the SmolLM2 tokenizer's, and so the tiny target's embedding rows


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("content")
    tok = load_tokenizer(SMOLLM2)
    target = save_tiny_target(root / "target", tok)
    rows = [chat_row(tok, q, a, i) for i, (q, a) in enumerate(CONVERSATIONS)]
    return {"root": root, "tok": tok, "target": target, "rows": rows}


def _data(tiny, tmp_path, edit=None):
    rows = json.loads(json.dumps(tiny["rows"]))  # a deep copy to edit
    if edit is not None:
        edit(rows)
    return write_datagen_dir(tmp_path / "data", tiny["target"], tiny["tok"], rows=rows)


def test_a_flipped_byte_in_the_arrow_file_fails_its_checksum(tiny, tmp_path):
    data = _data(tiny, tmp_path)
    (arrow,) = (data / "data").glob("data-*.arrow")
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest[data_format.CHECKSUMS_KEY] == data_format.data_checksums(data / "data")
    raw = bytearray(arrow.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    arrow.write_bytes(bytes(raw))
    done = run_cli("dflash-train", *tiny_train_args(tiny["target"], data, tmp_path / "run"))
    assert_one_line_error(done, "dflash-train", f"'{arrow}' is damaged (its sha256 does not match manifest.json)")
    assert not (tmp_path / "run").exists()


def _set(row: int, column: str, index: int, value):
    def edit(rows):
        rows[row][column][index] = value
    return edit


@pytest.mark.parametrize("edit, message", [
    # a flipped high bit of an int32 id: what a damaged copy of an older dataset (no checksums) holds
    (_set(3, "input_ids", 5, 1_500_000_000),
     f"row 3 holds token id 1500000000, outside the target's vocabulary of {VOCAB} (0..{VOCAB - 1})"),
    (_set(6, "input_ids", 2, VOCAB), f"row 6 holds token id {VOCAB}, outside the target's vocabulary"),
    (_set(1, "input_ids", 0, -1), "row 1 holds token id -1"),
    (_set(5, "loss_mask", 4, 2), "row 5 has loss_mask value 2 (only 0 and 1 are valid)"),
    (lambda rows: rows[2]["loss_mask"].pop(), "row 2 has loss_mask length"),
    (lambda rows: rows[4].update(num_tokens=rows[4]["num_tokens"] + 1), "row 4 has num_tokens"),
])
def test_rows_a_target_cannot_use_are_named_before_the_first_step(tiny, tmp_path, edit, message):
    data = _data(tiny, tmp_path, edit)
    with pytest.raises(ValueError, match=f"^{data}: " + message.replace("(", r"\(").replace(")", r"\)")):
        Trainer(tiny_train_config(tiny["target"], data, tmp_path / "run", max_steps=1))
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_an_out_of_vocabulary_id_is_one_line_from_the_command(tiny, tmp_path):
    data = _data(tiny, tmp_path, _set(7, "input_ids", 9, 60000))
    done = run_cli("dflash-train", *tiny_train_args(tiny["target"], data, tmp_path / "run"))
    assert_one_line_error(done, "dflash-train", f"{data}: row 7 holds token id 60000, outside the target's "
                                                f"vocabulary of {VOCAB} (0..{VOCAB - 1})")
    assert "IndexError" not in done.stderr


def test_an_empty_dataset_says_it_is_empty(tiny, tmp_path):
    data = write_datagen_dir(tmp_path / "data", tiny["target"], tiny["tok"], rows=[])
    # datasets writes no Arrow file at all for an empty table unless told num_shards=1
    shutil.rmtree(data / "data")
    datasets.Dataset(pa.Table.from_pylist([], schema=data_format.SCHEMA)).save_to_disk(str(data / "data"))
    done = run_cli("dflash-train", *tiny_train_args(tiny["target"], data, tmp_path / "run"))
    assert_one_line_error(done, "dflash-train", f"'{data}' is an empty dataset (its manifest counts 0 rows)")
    assert "unreadable" not in done.stderr
