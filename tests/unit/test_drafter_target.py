"""A drafter serves the target weights it was trained with: the export records their digest,
dflash-eval refuses another model of the same architecture (allow_other_target=true is the
explicit way to evaluate it anyway), and a resumed run notices new weights at the same path."""

import json
import shutil

import pytest
import torch

from dflash_train.model.io import TARGET_WEIGHTS_KEY
from dflash_train.model.target import load_tokenizer, weights_digest
from dflash_train.training.trainer import Trainer
from tests.cli_helpers import assert_one_line_error, run_cli
from tests.conftest import SMOLLM2
from tests.train_data import save_tiny_target, tiny_train_config, write_datagen_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A finished tiny run with its export, and a second tiny target of the same shape."""
    root = tmp_path_factory.mktemp("drafter-target")
    tok = load_tokenizer(SMOLLM2)
    target = save_tiny_target(root / "target", tok)
    other = save_tiny_target(root / "other", tok, seed=1)  # same architecture, other weights
    data = write_datagen_dir(root / "data", target, tok)
    Trainer(tiny_train_config(target, data, root / "run", max_steps=1, export=True)).fit()
    return {"root": root, "tok": tok, "target": target, "other": other, "data": data, "run": root / "run"}


def _eval(tiny, target, tmp_path, *extra):
    return run_cli("dflash-eval", f"drafter_path={tiny['run'] / 'export'}", f"target.name={target}",
                   "target.mask_token_id=16", "datasets=[mtbench]", "limit=1", "max_new_tokens=2",
                   f"output_dir={tmp_path / 'eval'}", *extra)


def test_the_export_records_the_target_weights(tiny):
    config = json.loads((tiny["run"] / "export" / "config.json").read_text())
    assert config[TARGET_WEIGHTS_KEY] == weights_digest(tiny["target"]) != weights_digest(tiny["other"])


def test_eval_refuses_a_drafter_for_other_target_weights(tiny, tmp_path):
    done = _eval(tiny, tiny["other"], tmp_path)
    assert_one_line_error(done, "dflash-eval", f"the drafter was trained for the target weights "
                          f"{weights_digest(tiny['target'])}, this target's are {weights_digest(tiny['other'])}",
                          "set allow_other_target=true if this is intended")
    assert not (tmp_path / "eval").exists()
    done = _eval(tiny, tiny["other"], tmp_path, "allow_other_target=true")
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((tmp_path / "eval" / "results.json").read_text())["datasets"]["mtbench"]["num_prompts"] == 1


def test_resume_notices_other_weights_at_the_same_path(tiny, tmp_path):
    target = tmp_path / "target"
    shutil.copytree(tiny["target"], target)
    cfg = tiny_train_config(str(target), tiny["data"], tmp_path / "run", max_steps=1, data={"check_manifest": False})
    Trainer(cfg).fit()
    before = weights_digest(str(target))
    save_tiny_target(target, tiny["tok"], seed=1)  # the same folder now holds other weights
    after = weights_digest(str(target))
    t = Trainer(tiny_train_config(str(target), tiny["data"], tmp_path / "run", max_steps=2,
                                  data={"check_manifest": False}))
    with pytest.raises(ValueError, match=f"other settings \\(target weights: '{before}' -> '{after}'\\): "
                                         "resume with the checkpoint's settings"):
        t.resume()


def test_warm_start_refuses_a_drafter_for_other_target_weights(tiny, tmp_path):
    export = tiny["run"] / "export"
    with pytest.raises(ValueError, match=rf"drafter.init_from={export}: the drafter was trained for the target "
                                         rf"weights {weights_digest(tiny['target'])}, this target's are "
                                         rf"{weights_digest(tiny['other'])}.*drafter.init_from_other_target=true"):
        Trainer(tiny_train_config(tiny["other"], tiny["data"], tmp_path / "refused", data={"check_manifest": False},
                                  drafter={"init_from": str(export)}))
    allowed = Trainer(tiny_train_config(tiny["other"], tiny["data"], tmp_path / "allowed",
                                        data={"check_manifest": False},
                                        drafter={"init_from": str(export), "init_from_other_target": True}))
    same = Trainer(tiny_train_config(tiny["target"], tiny["data"], tmp_path / "same", drafter={"init_from": str(export)}))
    for name, tensor in same.drafter.state_dict().items():
        assert torch.equal(tensor, allowed.drafter.state_dict()[name]), name
