"""The openai backend against a real local HTTP server: garbage and out-of-vocabulary answers
never become data or committed shards, and a rerun against a healthy server finishes."""

import json
import os
import threading
from http.server import ThreadingHTTPServer

import pytest

from dflash_train.data.format import load_generated
from dflash_train.model.target import load_tokenizer
from tests.cli_helpers import assert_one_line_error, run_cli, snapshot
from tests.conftest import SMOLLM2
from tests.datagen_helpers import JsonHandler
from tests.train_data import save_tiny_target

MODEL = "tiny"
HEALTHY_IDS = [28, 29, 30]  # three in-vocabulary tokens; finish_reason "length" at max_new_tokens=3


class Server:
    """An OpenAI-compatible /v1 endpoint whose /completions answers as ``self.mode`` says."""

    def __init__(self):
        server = self

        class Handler(JsonHandler):
            def do_GET(self):
                self.reply({"data": [{"id": MODEL}]})

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                server.requests += 1
                if server.mode == "unauthorized":  # vLLM's answer to a wrong --api-key
                    body = b'{"error": "Unauthorized"}'
                    self.send_response(401)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self.reply(server.answer())

        self.mode, self.requests = "healthy", 0
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def answer(self) -> bytes:
        choice = {"finish_reason": "length", "text": "", "token_ids": HEALTHY_IDS}
        if self.mode == "garbage":
            return b"<html>502 upstream hiccup</html>"
        if self.mode == "no_choices":
            return json.dumps({"object": "text_completion"}).encode()
        if self.mode == "out_of_range":
            choice["token_ids"] = [999999, -5, 3]
        if self.mode == "vocab_size":  # one past the last id: the first id outside the vocabulary
            choice["token_ids"] = [28, 49152, 30]
        if self.mode == "booleans":  # JSON true is not a token id, though Python's bool is an int
            choice["token_ids"] = [28, True, 30]
        if self.mode == "empty_length":  # nothing generated, yet "cut at the length limit"
            choice["token_ids"] = []
        return json.dumps({"choices": [choice]}).encode()


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.httpd.shutdown()


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_tiny_target(tmp_path_factory.mktemp("oa") / "target", load_tokenizer(SMOLLM2))


def _datagen(server, target, out, prompts):
    return run_cli("dflash-datagen", f"target.name={target}", f"out_dir={out}", "exclude_eval=[]",
                   f"sources=[{{kind: jsonl, path: {prompts}}}]", "shard_size=2", "sampling.max_new_tokens=3",
                   "backend.kind=openai", f"backend.base_url={server.url}", f"backend.model={MODEL}",
                   "backend.max_retries=0", "backend.backoff_s=0")


@pytest.mark.parametrize("mode, named", [("garbage", "not JSON"), ("no_choices", "no choices"),
                                         ("out_of_range", "token ids [999999, -5] outside the vocabulary [0, 49152)"),
                                         ("vocab_size", "token ids [49152] outside the vocabulary [0, 49152)"),
                                         ("booleans", "token_ids is not a list of integers: [28, True, 30]"),
                                         ("empty_length", "an empty answer with finish_reason='length'")])
def test_a_broken_server_commits_nothing_and_a_rerun_finishes(server, target, tmp_path, mode, named):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Question {i}?"}) + "\n" for i in range(3)))
    out = tmp_path / "out"
    server.mode = mode
    done = _datagen(server, target, out, prompts)
    lines = [line for line in done.stderr.splitlines() if "error" in line]
    assert done.returncode == 1 and len(lines) == 1, done.stderr[-2000:]
    # One call carries both shards' prompts (backend.max_concurrency of them)
    assert lines[0].startswith("dflash-datagen: error: shard 0, 1: 3 prompts failed") and named in lines[0]
    assert server.url in lines[0] and "rerun the same command" in lines[0]
    assert not list((out / "shards").glob("*.parquet")) and not (out / "manifest.json").exists()

    server.mode = "healthy"
    done = _datagen(server, target, out, prompts)
    assert done.returncode == 0, done.stderr[-2000:]
    data = load_generated(out)
    assert len(data) == 3
    for row in data:
        assert row["input_ids"][-3:] == HEALTHY_IDS and row["finish_reason"] == "length"


def test_a_truncated_shard_is_named(server, target, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Question {i}?"}) + "\n" for i in range(3)))
    out = tmp_path / "out"
    server.mode = "healthy"
    assert _datagen(server, target, out, prompts).returncode == 0
    (out / "manifest.json").unlink()  # as if killed before consolidating, then a shard got damaged
    shard = out / "shards" / "shard-00001.parquet"
    os.truncate(shard, shard.stat().st_size // 2)
    before = snapshot(out)
    done = _datagen(server, target, out, prompts)
    assert_one_line_error(done, "dflash-datagen", f"shard '{shard}' is damaged", "delete it and rerun")
    assert snapshot(out) == before


def test_a_refused_api_key_stops_at_once_and_records_nothing(server, target, tmp_path):
    """401 is no prompt's fault: one line naming the key setting, no shard, no prompt marked
    as failed, so the rerun with the right key generates every answer."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Question {i}?"}) + "\n" for i in range(3)))
    out = tmp_path / "out"
    server.mode, server.requests = "unauthorized", 0
    done = _datagen(server, target, out, prompts)
    assert_one_line_error(done, "dflash-datagen", f"HTTP 401 from {server.url}/completions",
                          "backend.api_key is not set", "rerun the same command")
    assert server.requests <= 3  # one generate call (both shards' prompts) at most: no further call was tried
    assert not list((out / "shards").glob("*.parquet")) and not (out / "manifest.json").exists()

    server.mode = "healthy"
    assert _datagen(server, target, out, prompts).returncode == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["rows"] == 3 and manifest["counts"]["skipped"] == {}
