"""wandb offline: a run directory appears and its history holds the logged training metrics."""

import json
import struct
import time

import pytest

from dflash_train.model.target import load_tokenizer
from dflash_train.training.trainer import Trainer
from tests.conftest import SMOLLM2
from tests.train_data import save_tiny_target, tiny_train_config, write_datagen_dir

wandb = pytest.importorskip("wandb")
LOG_BLOCK = 32768  # the .wandb file is a LevelDB-style log of 32 KiB blocks
CHUNK_HEADER = struct.Struct("<IHB")  # checksum, length, chunk type
FULL, LAST = 1, 4


def records(path):
    """Records of an offline .wandb file (wandb ships no Python reader for it)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, buf, out = 7, b"", []
    while pos + CHUNK_HEADER.size <= len(data):
        left = LOG_BLOCK - pos % LOG_BLOCK
        if left < CHUNK_HEADER.size:  # block trailer padding
            pos += left
            continue
        _, length, kind = CHUNK_HEADER.unpack_from(data, pos)
        if kind == 0:
            break
        buf += data[pos + CHUNK_HEADER.size:pos + CHUNK_HEADER.size + length]
        pos += CHUNK_HEADER.size + length
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            out.append(record)
    return out


def history(path, timeout_s: float = 60.0):
    """History rows, once wandb's service process has written the run's exit record."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in found) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    return [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for r in found if r.WhichOneof("record_type") == "history"]


def test_offline_run_history_holds_the_metrics(tmp_path):
    tok = load_tokenizer(SMOLLM2)
    target = save_tiny_target(tmp_path / "target", tok)
    data = write_datagen_dir(tmp_path / "data", target, tok)
    out = tmp_path / "run"
    Trainer(tiny_train_config(target, data, out, max_steps=2, logging={"wandb": "offline"})).fit()
    files = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    rows = history(files[0])
    assert [r["_step"] for r in rows] == [1, 2]
    for key in ("loss", "expected_tau", "acc_pos_1", "tokens_per_s", "samples_per_s", "lr", "peak_memory_gib"):
        assert all(key in r for r in rows), key
    jsonl = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in rows] == pytest.approx([j["loss"] for j in jsonl])
