"""Export at the end of training, dflash-export from a checkpoint, model card, Hub push (faked)."""

import json

import pytest
from safetensors.torch import load_file

from dflash_train.export import cli
from dflash_train.model import card as model_card
from dflash_train.model.io import load_drafter
from dflash_train.model.target import load_tokenizer
from dflash_train.training.trainer import Trainer
from tests.conftest import SMOLLM2
from tests.train_data import save_tiny_target, tiny_train_config, write_datagen_dir

TOKEN = "hf_sentinel_token_never_written"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_TOKEN", TOKEN)
    tok = load_tokenizer(SMOLLM2)
    target = save_tiny_target(root / "target", tok)
    data = write_datagen_dir(root / "data", target, tok)
    out = root / "run"
    Trainer(tiny_train_config(target, data, out, max_steps=2, export=True)).fit()
    mp.undo()
    return out


def _results(path):
    row = {"num_prompts": 3, "tau": 2.5, "greedy_agreement": 1.0, "spec_tok_s": 10.0, "plain_tok_s": 5.0,
           "speedup": 2.0, "prompts": []}
    path.write_text(json.dumps({"datasets": {"mtbench": row}}))
    return path


def test_training_exports_a_loadable_drafter_with_card(run):
    export = run / "export"
    drafter = load_drafter(export)
    assert drafter.block_size == 8
    card = (export / model_card.CARD).read_text()
    assert "DFlash drafter for" in card and "num_speculative_tokens\": 7" in card
    assert json.loads((export / model_card.MANIFEST).read_text())["format_version"] == 1
    assert "optim:" in (export / model_card.RECIPE).read_text()


def test_reexport_from_checkpoint_is_identical(run, tmp_path):
    cli.main([str(run), f"out={tmp_path / 'again'}", f"eval_results={_results(tmp_path / 'r.json')}"])
    a, b = load_file(run / "export" / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    card = (tmp_path / "again" / model_card.CARD).read_text()
    assert "mtbench" in card and "2.50" in card  # the dflash-eval table


def test_push_uses_recipe_repo_and_never_the_token(run, tmp_path, monkeypatch):
    calls = []

    class FakeApi:
        def create_repo(self, repo_id, private, repo_type, exist_ok):
            calls.append(("create", repo_id, private))

        def upload_folder(self, repo_id, folder_path, repo_type, commit_message):
            calls.append(("upload", repo_id, sorted(p.name for p in __import__("pathlib").Path(folder_path).iterdir())))
            return "commit-url"

    monkeypatch.setattr("huggingface_hub.HfApi", FakeApi)
    cli.main([str(run), f"out={tmp_path / 'push'}", "push=true", "repo_id=me/drafter", "private=false"])
    assert calls[0] == ("create", "me/drafter", False)
    assert {"README.md", "config.json", "model.safetensors", "dflash.py"} <= set(calls[1][2])
    for f in [*run.rglob("*"), *(tmp_path / "push").rglob("*")]:
        if f.is_file():
            assert TOKEN.encode() not in f.read_bytes(), f


def _user_error(argv, capsys) -> str:
    """The one stderr line of a dflash-export that refuses ``argv`` (exit status 2)."""
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dflash-export: error: ")
    return lines[0]


def test_push_without_repo_id_names_the_missing_setting(run, tmp_path, capsys, monkeypatch):
    # the run's recipe names no hub.repo_id and the command gives none: the Hub is never called
    monkeypatch.setattr("huggingface_hub.HfApi", lambda: pytest.fail("HfApi built without a repository"))
    assert "repo_id=<user>/<name>" in _user_error([str(run), f"out={tmp_path / 'x'}", "push=true"], capsys)


def test_a_folder_without_checkpoints_is_refused_by_name(tmp_path, capsys):
    line = _user_error([str(tmp_path), f"out={tmp_path / 'x'}"], capsys)
    assert f"{tmp_path} is neither a checkpoint (no trainer_state.json) nor a run directory" in line
    assert list(tmp_path.iterdir()) == []  # nothing exported
