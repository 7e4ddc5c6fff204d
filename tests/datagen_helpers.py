"""Shared by the dflash-datagen subprocess tests: one set of overrides drives both the
console command and the in-process reference run, so the two are the same config."""

import json
import os
import signal
import time
import types
from http.server import BaseHTTPRequestHandler

from hydra import compose, initialize_config_module

import data_gen.generators
import data_gen.pipeline
from data_gen.config import DatagenConfig, to_datagen_config
from data_gen.engine import GenerationEngine
from data_gen.hf_generator import HFGenerator
from tests.cli_helpers import start_cli

QUESTIONS = ["What is {a}+{b}? Answer with one number.", "Is {a} bigger than {b}? Answer yes or no."]


def write_prompts(path, n: int) -> None:
    prompts = [QUESTIONS[i % 2].format(a=i + 2, b=3 * i + 1) for i in range(n)]
    path.write_text("\n".join(json.dumps({"prompt": p}) for p in prompts))


def write_conversations(path, n: int) -> None:
    """n conversations of one, two and three user turns in turn (their old answers are regenerated)."""
    lines = []
    for i in range(n):
        users = [QUESTIONS[(i + t) % 2].format(a=i + t + 2, b=3 * i + 1) for t in range(i % 3 + 1)]
        messages = [m for u in users for m in ({"role": "user", "content": u}, {"role": "assistant", "content": "old"})]
        lines.append(json.dumps({"messages": messages}))
    path.write_text("\n".join(lines))


def overrides(out_dir, prompts_file, shard_size: int, batch_size: int, max_new_tokens: int = 6) -> list[str]:
    return [f"out_dir={out_dir}", "exclude_eval=[]", f"sources=[{{kind: jsonl, path: {prompts_file}}}]",
            f"shard_size={shard_size}", f"backend.batch_size={batch_size}", "backend.cpu_threads=1",
            f"sampling.max_new_tokens={max_new_tokens}"]


def kill_after_first_shard(args: list[str], out_dir) -> list:
    """Run dflash-datagen with ``args`` (forked from a warm Python, as run_cli's commands),
    SIGKILL it once its first shard is committed, and return the shard files it left (the run
    must not end before that shard, or within 180 s)."""
    from dflash_train.data.format import shard_path

    proc = start_cli("dflash-datagen", *args)
    try:
        deadline = time.time() + 180
        while not shard_path(out_dir, 0).exists():
            assert proc.poll() is None and time.time() < deadline, "the run ended before its first shard"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    return sorted((out_dir / "shards").glob("shard-*.parquet"))


def compose_config(args: list[str]) -> DatagenConfig:
    with initialize_config_module("dflash_recipes", version_base=None):
        raw = compose("datagen", overrides=args)
    return to_datagen_config(raw)


class JsonHandler(BaseHTTPRequestHandler):
    """A quiet HTTP handler that answers JSON: the base of the tests' OpenAI-compatible servers."""

    def log_message(self, *args):
        pass

    def reply(self, payload) -> None:
        """Send ``payload`` (JSON-encoded, or raw bytes as they are) with status 200."""
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def an_hour_after_each_batch(monkeypatch):
    """Drive the datagen budget's clock: every HF generation batch moves it an hour on once the
    batch is done. Returns the original batch method, to put back."""
    now = [1000.0]
    monkeypatch.setattr(data_gen.generators, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(data_gen.pipeline, "time", types.SimpleNamespace(monotonic=lambda: now[0],
                                                                         perf_counter=time.perf_counter))
    first_batch = HFGenerator._batch

    def then_late(self, prompts, seeds):
        out = first_batch(self, prompts, seeds)
        now[0] += 3600
        return out

    monkeypatch.setattr(HFGenerator, "_batch", then_late)
    return first_batch


class Clock:
    """time.monotonic for data_gen.generators.past: moved by the test, not by the machine."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def an_hour_after_each_admission(monkeypatch) -> Clock:
    """Drive the datagen budget's clock: it moves an hour on each time the engine admits queued
    prompts into its slots (those are in flight; after the first admission nothing starts)."""
    clock = Clock()
    monkeypatch.setattr(data_gen.generators, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    monkeypatch.setattr(data_gen.pipeline, "time", types.SimpleNamespace(monotonic=clock.monotonic,
                                                                         perf_counter=time.perf_counter))
    admit = GenerationEngine._admit

    def then_late(self, deadline):
        queued = len(self.queue)
        admit(self, deadline)
        if len(self.queue) < queued:
            clock.now += 3600

    monkeypatch.setattr(GenerationEngine, "_admit", then_late)
    return clock
