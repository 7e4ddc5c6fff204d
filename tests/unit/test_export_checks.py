"""dflash-export on checkpoints that cannot be verified and pushes that cannot finish: a
checkpoint without its checksums where the run writes them is damage, one of an older
version is exported with a warning; a push without a repository fails before exporting, and
a push to an unreachable hub says in one line that the export is on disk."""

import json
import shutil

import pytest
from safetensors.torch import load_file

from dflash_train.training.checkpoint import CHECKSUMS_FILE, STATE_FILE, list_checkpoints
from dflash_train.training.trainer import Trainer
from tests.cli_helpers import assert_one_line_error, run_cli, snapshot
from tests.train_data import tiny_inputs, tiny_train_config


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished tiny run with two checkpoints (steps 1 and 2) and its export."""
    tiny = tiny_inputs(tmp_path_factory.mktemp("exp"))
    out = tiny["root"] / "run"
    Trainer(tiny_train_config(tiny["target"], tiny["data"], out, max_steps=2, export=True,
                              checkpoint={"every": 1})).fit()
    return out


def _copy(run, tmp_path):
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run", list_checkpoints(tmp_path / "run")


def _flip_one_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_checkpoint_without_its_checksums_and_a_flipped_byte_is_not_exported(run, tmp_path):
    out, (first, last) = _copy(run, tmp_path)
    (last / CHECKSUMS_FILE).unlink()
    _flip_one_byte(last / "model.pt")
    for path in (last, out):  # the checkpoint itself, and the run whose latest checkpoint it is
        done = run_cli("dflash-export", path, f"out={tmp_path / 'exp'}")
        if path == last:
            assert_one_line_error(done, "dflash-export", f"checkpoint {last} is damaged",
                                  f"{CHECKSUMS_FILE} is missing where this run writes one")
        else:  # the run falls back to its previous, intact checkpoint
            assert done.returncode == 0, done.stderr[-2000:]
            assert f"exported {first} to" in done.stdout
    # Even alone (no sibling with checksums), a checkpoint of this version lacking them is damage.
    shutil.rmtree(first)
    assert_one_line_error(run_cli("dflash-export", last, f"out={tmp_path / 'exp2'}"), "dflash-export",
                          f"{CHECKSUMS_FILE} is missing where this run writes one")
    assert not (tmp_path / "exp2").exists()


def test_an_older_checkpoint_without_checksums_is_exported_with_a_warning(run, tmp_path):
    out, (first, last) = _copy(run, tmp_path)
    shutil.rmtree(first)
    state = json.loads((last / STATE_FILE).read_text())
    del state["format"]  # as written before checkpoints carried checksums
    (last / STATE_FILE).write_text(json.dumps(state))
    (last / CHECKSUMS_FILE).unlink()
    done = run_cli("dflash-export", last, f"out={tmp_path / 'exp'}")
    assert done.returncode == 0, done.stderr[-2000:]
    ours = [line for line in done.stderr.splitlines() if line.startswith("dflash-export:")]
    assert ours == [f"dflash-export: warning: {last} has no {CHECKSUMS_FILE} (a checkpoint of an older version): "
                        "its files cannot be verified"]
    exported = load_file(str(tmp_path / "exp" / "model.safetensors"))
    assert set(exported) == set(load_file(str(run / "export" / "model.safetensors")))


def test_push_without_a_repository_names_the_key_and_exports_nothing(run, tmp_path):
    out, _ = _copy(run, tmp_path)
    before = snapshot(out)
    done = run_cli("dflash-export", out, f"out={tmp_path / 'exp'}", "push=true")
    line = assert_one_line_error(done, "dflash-export", "push=true needs a Hub repository: add repo_id=<user>/<name>")
    assert "hub.repo_id=" not in line  # not a key dflash-export takes
    assert not (tmp_path / "exp").exists() and snapshot(out) == before


def test_push_to_an_unreachable_hub_is_one_line_and_the_export_stays(run, tmp_path):
    out, (_, last) = _copy(run, tmp_path)
    env = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_TOKEN": "hf_not_a_real_token", "HF_HUB_ETAG_TIMEOUT": "2"}
    done = run_cli("dflash-export", out, f"out={tmp_path / 'exp'}", "push=true", "repo_id=me/drafter", env=env)
    assert_one_line_error(done, "dflash-export", "push to me/drafter failed (ConnectError",
                          f"the export is on disk at {tmp_path / 'exp'}",
                          f"dflash-export {last} out={tmp_path / 'exp'} push=true repo_id=me/drafter")
    assert "hf_not_a_real_token" not in done.stderr + done.stdout
    assert load_file(str(tmp_path / "exp" / "model.safetensors")).keys() == \
        load_file(str(run / "export" / "model.safetensors")).keys()
