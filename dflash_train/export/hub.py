"""Model card generation and pushing an exported drafter to the Hugging Face Hub.

A run exports its drafter to ``<output_dir>/EXPORT_DIR`` and keeps the data manifest at
``<output_dir>/MANIFEST_COPY``, where ``dflash-export`` finds it again for the model card.

The token comes only from huggingface_hub's own lookup (HF_TOKEN or ``hf auth login``); it
is never read, logged or written here.
"""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import OmegaConf

from dflash_train.eval.report import format_table
from dflash_train.model.io import CARD_NAME as CARD
from dflash_train.model.io import MANIFEST_NAME as MANIFEST
from dflash_train.model.io import RECIPE_NAME as RECIPE

EXPORT_DIR = "export"
MANIFEST_COPY = "data_manifest.json"


def eval_table(results_path: str | Path) -> str:
    """The table dflash-eval prints, rebuilt from its results.json."""
    report = json.loads(Path(results_path).read_text())
    summaries = {label: {k: v for k, v in d.items() if k != "prompts"} for label, d in report["datasets"].items()}
    return format_table(summaries)


def model_card(recipe: dict, manifest: dict | None, table: str | None) -> str:
    target = recipe["target"]["name"]
    d = recipe["drafter"]
    lines = [
        "---",
        "library_name: transformers",
        "tags: [dflash, speculative-decoding, block-diffusion, drafter]",
        "---",
        f"# DFlash drafter for {target}",
        "",
        f"A {d['num_hidden_layers']}-layer DFlash block-diffusion drafter (block size {d['block_size']}) "
        f"trained with dflash-train for the target `{target}`. It has no embedding and no LM head: "
        "it uses the target's, so serve it with the same target weights.",
        "",
        "## Serving",
        "```",
        f"vllm serve {target} --speculative-config '{{\"method\": \"dflash\", \"model\": \"DIR\", "
        f"\"num_speculative_tokens\": {d['block_size'] - 1}}}' --attention-backend flash_attn",
        f"python -m sglang.launch_server --model-path {target} --speculative-algorithm DFLASH "
        f"--speculative-draft-model-path DIR --speculative-num-draft-tokens {d['block_size']}",
        "```",
        "",
        "## Acceptance (dflash-eval)",
        "```",
        table or ("not evaluated yet: run dflash-eval drafter_path=DIR and re-export with "
                  "dflash-export eval_results=<results.json>"),
        "```",
        "",
        "## Training data",
        "```json",
        json.dumps(manifest, indent=2, sort_keys=True) if manifest else "no manifest (data.check_manifest was off)",
        "```",
        "",
        f"## Recipe\nSee `{RECIPE}` beside this card.",
        "",
    ]
    return "\n".join(lines)


def model_card_files(recipe: dict, manifest: dict | None, eval_results: str | Path | None) -> dict[str, str]:
    """{file name: text} written beside an exported drafter."""
    table = eval_table(eval_results) if eval_results else None
    files = {CARD: model_card(recipe, manifest, table), RECIPE: OmegaConf.to_yaml(recipe)}
    if manifest:
        files[MANIFEST] = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    return files


def push_to_hub(export_dir: str | Path, repo_id: str, private: bool) -> str:
    """Create (or reuse) ``repo_id`` and upload the export folder; returns the commit URL."""
    from huggingface_hub import HfApi

    if not repo_id:
        raise ValueError("repo_id is empty: add repo_id=<user>/<name> to push")
    api = HfApi()  # the token is huggingface_hub's business: environment or cached login
    api.create_repo(repo_id, private=private, repo_type="model", exist_ok=True)
    info = api.upload_folder(repo_id=repo_id, folder_path=str(export_dir), repo_type="model",
                             commit_message="Upload DFlash drafter (dflash-train)")
    return str(info)
