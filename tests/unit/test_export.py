"""Contract section 4: the exported format, interoperability, and safe loading."""

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_train.model.dflash import DFlashConfig, DFlashDraftModel
from dflash_train.model.io import load_drafter, save_drafter
from dflash_train.model.target import TargetModel
from tests.conftest import make_tiny_target

REPO = Path(__file__).resolve().parents[2]
TF457_PYTHON = REPO / ".venv-tf457" / "bin" / "python"  # made by `make setup-test`


@pytest.fixture(scope="module")
def target():
    return make_tiny_target("qwen3")


@pytest.fixture(scope="module")
def export(target, tmp_path_factory):
    torch.manual_seed(3)
    cfg = DFlashConfig.from_target(target.config, mask_token_id=96, num_hidden_layers=2, block_size=4)
    drafter = DFlashDraftModel(cfg).eval()
    out = save_drafter(drafter, tmp_path_factory.mktemp("exp") / "drafter")
    return drafter, out


def _inputs():
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(1, 4, 64, generator=g)
    ctx = torch.randn(1, 7, 128, generator=g)
    positions = (torch.arange(11) + 3)[None]
    return noise, ctx, positions


def test_config_and_weight_names_follow_the_contract(export):
    _, out = export
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "dflash.py", "model.safetensors"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert cfg["block_size"] == 4 and cfg["num_target_layers"] == 6 and cfg["num_hidden_layers"] == 2
    assert cfg["dflash_config"] == {"mask_token_id": 96, "target_layer_ids": [1, 3], "causal": False, "use_swa": False}
    # the keys only serving engines read (tests/unit/test_serving_keys.py reads them as they do)
    assert cfg["is_causal"] is False and cfg["target_hidden_size"] == 64 and cfg["draft_vocab_size"] == 97
    assert cfg["rope_is_neox_style"] is True and cfg["is_neox_style"] is True
    assert cfg["hidden_act"] == "silu" and cfg["tie_word_embeddings"] is False
    assert cfg["rope_theta"] == 10000.0 and cfg["layer_types"] == ["full_attention"] * 2
    assert "eagle_aux_hidden_state_layer_ids" not in cfg
    names = set(load_file(str(out / "model.safetensors")))
    per_layer = [f"layers.{i}.{n}.weight" for i in range(2) for n in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
        "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
        "post_attention_layernorm")]
    assert names == {"fc.weight", "hidden_norm.weight", "norm.weight", *per_layer}
    source = (out / "dflash.py").read_text()
    imports = {line.split()[1].split(".")[0] for line in source.splitlines() if line.startswith(("import ", "from "))}
    assert imports <= {"__future__", "math", "time", "dataclasses", "torch", "transformers"}


def test_reference_package_loads_and_matches(export):
    reference = pytest.importorskip("dflash.model", reason="install with: pip install --no-deps dflash==0.1.0")
    drafter, out = export
    ref, info = reference.DFlashDraftModel.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    noise, ctx, positions = _inputs()
    with torch.no_grad():
        ours = drafter(noise, ctx, positions)
        theirs = ref.eval()(position_ids=positions, noise_embedding=noise, target_hidden=ctx)
    assert (ours - theirs).abs().max() < 1e-4


def test_reference_runtime_and_ours_agree_on_greedy_output(export, target):
    reference = pytest.importorskip("dflash.model")
    drafter, out = export
    ref = reference.DFlashDraftModel.from_pretrained(out).eval()
    ids = torch.randint(0, 90, (1, 9), generator=torch.Generator().manual_seed(5))
    theirs = ref.spec_generate(target, ids, 24, None)
    ours = drafter.spec_generate(target, ids, 24)
    assert torch.equal(ours, theirs)


def test_automodel_remote_code_loads_the_folder_alone(export, target):
    from transformers import AutoModel

    drafter, out = export
    remote = AutoModel.from_pretrained(out, trust_remote_code=True).eval()
    assert type(remote).__module__.startswith("transformers_modules")  # our dflash.py, not this package
    noise, ctx, positions = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(remote(noise_embedding=noise, target_hidden=ctx, position_ids=positions),
                                   drafter(noise, ctx, positions), atol=1e-6, rtol=1e-6)
    ids = torch.randint(0, 90, (1, 9), generator=torch.Generator().manual_seed(6))
    got = remote.spec_generate(input_ids=ids, max_new_tokens=20, temperature=0.0, target=target,
                               mask_token_id=96, stop_token_ids=None)
    assert torch.equal(got, target.generate(ids, max_new_tokens=20, do_sample=False))
    shorter = remote.spec_generate(input_ids=ids, max_new_tokens=20, target=target, verify_tokens=1, return_stats=True)
    assert torch.equal(shorter.output_ids, got) and max(shorter.acceptance_lengths) <= 2


TF457_SCRIPT = """
import sys, torch, transformers
from safetensors.torch import load_file
from transformers import AutoModel, AutoModelForCausalLM
assert transformers.__version__.startswith("4.57"), transformers.__version__
out, target_dir, io_file, repo = sys.argv[1:]
sys.path.insert(0, repo)  # the static runtime is the project's (model/runtime.py), not exported
from dflash_train.model.runtime import spec_generate
model = AutoModel.from_pretrained(out, trust_remote_code=True).eval()
target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
t = load_file(io_file)
with torch.no_grad():
    got = model(noise_embedding=t["noise"], target_hidden=t["ctx"], position_ids=t["positions"])
print("maxdiff", float((got - t["expected"]).abs().max()))
ids = t["ids"]
spec = model.spec_generate(input_ids=ids, max_new_tokens=20, temperature=0.0, target=target, mask_token_id=96,
                           stop_token_ids=None)
plain = target.generate(ids, max_new_tokens=20, do_sample=False)
print("lossless", bool(torch.equal(spec, plain)))
static = spec_generate(model, target, ids, 20, mask_token_id=96, static=True)
print("static", bool(torch.equal(static, plain)))
"""


def test_export_loads_under_transformers_457(export, target, tmp_path):
    assert TF457_PYTHON.exists(), f"{TF457_PYTHON} missing: run `make setup-test` (it builds the transformers 4.57 venv)"
    drafter, out = export
    target.save_pretrained(tmp_path / "target")
    noise, ctx, positions = _inputs()
    with torch.no_grad():
        expected = drafter(noise, ctx, positions)
    ids = torch.randint(0, 90, (1, 9), generator=torch.Generator().manual_seed(7))
    save_file({"noise": noise, "ctx": ctx, "positions": positions, "expected": expected, "ids": ids},
              str(tmp_path / "io.safetensors"))
    run = subprocess.run([str(TF457_PYTHON), "-c", TF457_SCRIPT, str(out), str(tmp_path / "target"),
                          str(tmp_path / "io.safetensors"), str(REPO)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = dict(line.split() for line in run.stdout.splitlines() if line.startswith(("maxdiff", "lossless", "static")))
    assert float(lines["maxdiff"]) < 1e-5
    assert lines["lossless"] == "True"
    assert lines["static"] == "True"  # the static runtime's cache classes work with 4.57's Cache too


def test_load_validates_against_the_target(export):
    drafter, out = export
    loaded = load_drafter(out, TargetModel(make_tiny_target("qwen3")))
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor)
    with pytest.raises(ValueError, match="num_target_layers=6 but the target has 8"):
        load_drafter(out, TargetModel(make_tiny_target("qwen3", layers=8)))
    with pytest.raises(ValueError, match="hidden_size=64 but the target has 32"):
        load_drafter(out, TargetModel(make_tiny_target("qwen3", hidden_size=32, intermediate_size=64)))
    with pytest.raises(ValueError, match="mask_token_id=96 but the target's embedding has 50 rows"):
        load_drafter(out, TargetModel(make_tiny_target("qwen3", vocab=50)))


def copy_export(src: Path, dst: Path, edit=None) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    if edit:
        cfg = json.loads((dst / "config.json").read_text())
        edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("edit,message", [
    (lambda c: c["dflash_config"].update(target_layer_ids=[1, 6]), r"target_layer_ids=\[1, 6\] but num_target_layers is 6"),
    (lambda c: c["dflash_config"].update(mask_token_id=97), "mask_token_id=97 is outside the vocabulary"),
    (lambda c: c.pop("block_size"), r"missing required key\(s\) \['block_size'\]"),
    (lambda c: c["dflash_config"].pop("mask_token_id"), "missing required key dflash_config.mask_token_id"),
])
def test_bad_config_is_a_clear_error(export, tmp_path, edit, message):
    bad = copy_export(export[1], tmp_path / "bad", edit)
    with pytest.raises(ValueError, match=message):
        load_drafter(bad)


def test_truncated_weights_are_a_clear_error(export, tmp_path):
    bad = copy_export(export[1], tmp_path / "bad")
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="unreadable safetensors file"):
        load_drafter(bad)


def test_a_failed_export_writes_nothing(export, tmp_path):
    drafter, _ = export
    state = dict(drafter.state_dict())
    state.pop("fc.weight")
    with pytest.raises(ValueError, match=r"missing \['fc.weight'\]"):
        save_drafter(drafter, tmp_path / "out", state_dict=state)
    assert list(tmp_path.iterdir()) == []


def test_reexport_replaces_atomically(export, tmp_path):
    drafter, _ = export
    out = save_drafter(drafter, tmp_path / "out")
    save_drafter(drafter, out, extra_files={"README.md": "card"})
    assert (out / "README.md").read_text() == "card"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp or backup dirs left


def test_loading_never_unpickles(export, monkeypatch):
    # weights are read with safetensors only: a pickle-based torch.load would run arbitrary code
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load called"))
    assert isinstance(load_drafter(export[1]), DFlashDraftModel)
