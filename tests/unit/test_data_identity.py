"""Data identity by content: the same weights under any path are accepted, a real difference
(weights, vocabulary, chat template) is refused naming the field."""

import json
import shutil

import pytest

from dflash_train.model.target import target_identity, tokenizer_identity, weights_digest
from dflash_train.resources import resolve_path
from dflash_train.training.trainer import Trainer
from tests.conftest import SMOLLM2
from tests.train_data import save_tiny_target, tiny_inputs, tiny_train_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_inputs(tmp_path_factory.mktemp("ident"))


def test_the_same_weights_under_another_path_are_accepted(tiny, tmp_path):
    moved = shutil.copytree(tiny["target"], tmp_path / "copied" / "model")
    (tmp_path / "link").symlink_to(moved)
    for spec in (str(moved), str(tmp_path / "link")):
        assert weights_digest(spec) == weights_digest(tiny["target"])
        t = Trainer(tiny_train_config(spec, tiny["data"], tmp_path / "run", max_steps=1))
        assert t.manifest["target"]["spec"] == tiny["target"]


def test_a_gguf_file_is_the_same_target_under_any_name(tmp_path):
    original = resolve_path(SMOLLM2, "test")
    (tmp_path / "renamed.gguf").symlink_to(original)
    shutil.copyfile(original, tmp_path / "copy.gguf")
    assert weights_digest(str(tmp_path / "renamed.gguf")) == weights_digest(SMOLLM2)
    assert weights_digest(str(tmp_path / "copy.gguf")) == weights_digest(SMOLLM2)


def test_other_weights_are_refused_naming_the_field(tiny, tmp_path):
    other = save_tiny_target(tmp_path / "other", tiny["tok"], seed=1)  # same shapes, other values
    with pytest.raises(ValueError, match=r"generated with target.weights='weights-\w+' but the target has "
                                         r"target.weights='weights-\w+'"):
        Trainer(tiny_train_config(other, tiny["data"], tmp_path / "run"))


def test_another_chat_template_is_refused_naming_the_field(tiny, tmp_path):
    edited = shutil.copytree(tiny["target"], tmp_path / "edited")
    config_file = edited / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    template = config.get("chat_template") or (edited / "chat_template.jinja").read_text()
    if "chat_template" in config:
        config["chat_template"] = template + "{# edited #}"
        config_file.write_text(json.dumps(config))
    else:
        (edited / "chat_template.jinja").write_text(template + "{# edited #}")
    assert weights_digest(str(edited)) == weights_digest(tiny["target"])
    with pytest.raises(ValueError, match="generated with tokenizer.chat_template_sha256="):
        Trainer(tiny_train_config(str(edited), tiny["data"], tmp_path / "run"))


def test_tokenizer_identity_leaves_out_what_does_not_change_labels(tiny):
    ident = tokenizer_identity(tiny["tok"])
    assert set(ident) == {"vocab_size", "vocab_sha256", "chat_template_sha256"} and ident["vocab_size"] == 49152
    manifest = json.loads((tiny["data"] / "manifest.json").read_text())
    assert manifest["tokenizer"] == ident and manifest["target"] == target_identity(tiny["target"])


def test_resume_under_another_path_to_the_same_weights_is_not_a_change(tiny, tmp_path):
    Trainer(tiny_train_config(tiny["target"], tiny["data"], tmp_path / "run", max_steps=1)).fit()
    moved = shutil.copytree(tiny["target"], tmp_path / "moved")
    t = Trainer(tiny_train_config(str(moved), tiny["data"], tmp_path / "run", max_steps=2))
    t.resume()
    assert t.state.step == 1


def test_a_gguf_and_the_dequantized_copy_the_tools_wrote_are_one_target(tiny, tmp_path):
    """The tools dequantize a GGUF once into a cached folder; given that folder as the target
    (target.name=<the copy>), it is the GGUF's weights, not another model. A copy whose
    weights changed since is another model again."""
    from dflash_train.model.target import SOURCE_FILE, resolve_target

    copy = resolve_target(SMOLLM2)
    assert weights_digest(copy) == weights_digest(SMOLLM2)
    edited = tmp_path / "copy"
    shutil.copytree(tiny["target"], edited)
    own = weights_digest(str(edited))
    (edited / SOURCE_FILE).write_text(json.dumps({"gguf": "m.gguf", "digest": "abc", "weights": own}))
    assert weights_digest(str(edited)) == "gguf-abc"
    weights = next(edited.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-1] + b"\x01")
    assert weights_digest(str(edited)) not in ("gguf-abc", own)
