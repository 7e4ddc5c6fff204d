"""The on-disk contract of dflash-datagen outputs: shards, consolidation, manifest checks."""

import json

import pytest

from dflash_train.data import format as data_format


def row(pid, n_prompt, n_response):
    ids = list(range(n_prompt + n_response))
    return {"input_ids": ids, "loss_mask": [0] * n_prompt + [1] * n_response, "prompt_id": pid, "source": "s",
            "finish_reason": "stop", "prompt_len": n_prompt, "response_len": n_response,
            "num_tokens": n_prompt + n_response}


def manifest(rows):
    return {"format_version": data_format.FORMAT_VERSION, "target": {"spec": "t", "revision": "r1"},
            "tokenizer_hash": "h1", "template": {}, "sampling": {}, "counts": {"rows": rows}}


def test_shards_consolidate_in_order(tmp_path):
    data_format.check_run(tmp_path, {"seed": 0})  # a run records its settings before any shard
    data_format.write_shard(tmp_path, 1, [row("c", 2, 1)], {"shard": 1})
    data_format.write_shard(tmp_path, 0, [row("a", 3, 2), row("b", 1, 1)], {"shard": 0})
    assert data_format.read_shard_meta(tmp_path, 1) == {"shard": 1}
    assert data_format.read_shard_meta(tmp_path, 2) is None
    assert not list((tmp_path / "shards").glob(".*")), "no temporary files left behind"
    data_format.consolidate(tmp_path, range(2), manifest(3))
    data = data_format.load_generated(tmp_path)
    assert data["prompt_id"] == ["a", "b", "c"]
    assert data[0] == row("a", 3, 2)
    assert data_format.read_manifest(tmp_path)["counts"]["rows"] == 3


def test_missing_and_partial_outputs_are_refused(tmp_path):
    with pytest.raises(ValueError, match="no manifest.json: not a dflash-datagen output"):
        data_format.load_generated(tmp_path)
    data_format.check_run(tmp_path, {"seed": 0})
    data_format.write_shard(tmp_path, 0, [row("a", 1, 1)], {})
    with pytest.raises(ValueError, match="an unfinished dflash-datagen run"):
        data_format.load_generated(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest(1)))
    with pytest.raises(ValueError, match="has a manifest but no data/ folder"):
        data_format.load_generated(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({**manifest(1), "format_version": 99}))
    with pytest.raises(ValueError, match="format_version=99"):
        data_format.read_manifest(tmp_path)


def test_restart_with_other_settings_is_refused(tmp_path):
    data_format.check_run(tmp_path, {"seed": 0, "shard_size": 4})
    data_format.check_run(tmp_path, {"seed": 0, "shard_size": 4})
    with pytest.raises(ValueError, match="holds a run with seed=0, this one has seed=1"):
        data_format.check_run(tmp_path, {"seed": 1, "shard_size": 4})


TOKENIZER = {"vocab_size": 5, "vocab_sha256": "v1", "chat_template_sha256": "t1"}


def test_check_target_compares_content_and_names_the_field():
    m = {**manifest(1), "target": {"spec": "t", "weights": "weights-w1", "revision": "r1"}, "tokenizer": TOKENIZER}
    # another spec and path, the same weights and tokenizer: accepted
    data_format.check_target(m, {"spec": "/elsewhere/t", "weights": "weights-w1", "name_or_path": "/x"}, TOKENIZER, "h2")
    with pytest.raises(ValueError, match="generated with target.weights='weights-w1' but the target has "
                                         "target.weights='weights-w2'"):
        data_format.check_target(m, {"weights": "weights-w2"}, TOKENIZER)
    for key in ("vocab_sha256", "chat_template_sha256"):
        with pytest.raises(ValueError, match=f"tokenizer.{key}='{TOKENIZER[key]}' but the target has "
                                             f"tokenizer.{key}='other'"):
            data_format.check_target(m, {"weights": "weights-w1"}, {**TOKENIZER, key: "other"})


def test_check_target_reads_older_manifests():
    m = manifest(1)  # revision and one tokenizer hash only
    data_format.check_target(m, {"spec": "t", "revision": "r1", "weights": "weights-x"}, TOKENIZER, "h1")
    with pytest.raises(ValueError, match="generated with target.revision='r1' but the target has target.revision='r2'"):
        data_format.check_target(m, {"revision": "r2"}, TOKENIZER, "h1")
    with pytest.raises(ValueError, match="tokenizer_hash='h1' but the target has tokenizer_hash='h2'"):
        data_format.check_target(m, {"revision": "r1", "weights": "weights-x"}, TOKENIZER, "h2")


def test_an_older_gguf_manifest_survives_another_transformers_version():
    # The shared Qwen2.5-Coder data: made where the old hash was 0cfe8c7b28467fb5 and the stop
    # ids [151645]; read where transformers gives 60ee5e82eb81ae3c and [151645, 151643]. The
    # GGUF digest (which covers the vocabulary inside the file) and the template agree.
    m = {**manifest(1), "target": {"spec": "qwen25coder05b.gguf", "revision": "gguf-037fa5a3c28c1932"},
         "tokenizer_hash": "0cfe8c7b28467fb5",
         "template": {"chat_template_sha256": "cd8e9439f0570856", "stop_token_ids": [151645]}}
    here = {"spec": "/models/q.gguf", "revision": "gguf-037fa5a3c28c1932", "weights": "gguf-037fa5a3c28c1932"}
    tokenizer = {"vocab_size": 151665, "vocab_sha256": "any", "chat_template_sha256": "cd8e9439f0570856"}
    data_format.check_target(m, here, tokenizer, "60ee5e82eb81ae3c")
    with pytest.raises(ValueError, match="tokenizer_hash='0cfe8c7b28467fb5'"):  # another template: refused
        data_format.check_target(m, here, {**tokenizer, "chat_template_sha256": "different"}, "60ee5e82eb81ae3c")
