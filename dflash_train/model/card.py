"""The model card, recipe and data manifest written beside an exported drafter.

Both the trainer (its final export) and dflash-export write them, so they live here, below
both: the card's acceptance table comes in as text (eval/report.py's results_table).
"""

from __future__ import annotations

import json

from omegaconf import OmegaConf

from dflash_train.model.io import CARD_NAME as CARD
from dflash_train.model.io import MANIFEST_NAME as MANIFEST
from dflash_train.model.io import RECIPE_NAME as RECIPE


def _serving(target: str, kind: str, block: int) -> list[str]:
    """The vLLM and SGLang commands: DFlash drafts B - 1 tokens a step and verifies B, DSpark
    (DeepSpec's layout, docs/design/dspark-dflash2.md 3.4) drafts B and verifies B + 1."""
    method, algorithm, drafts = ("dspark", "DSPARK", block) if kind == "dspark" else ("dflash", "DFLASH", block - 1)
    return [f"vllm serve {target} --speculative-config '{{\"method\": \"{method}\", \"model\": \"DIR\", "
            f"\"num_speculative_tokens\": {drafts}}}' --attention-backend flash_attn",
            f"python -m sglang.launch_server --model-path {target} --speculative-algorithm {algorithm} "
            f"--speculative-draft-model-path DIR --speculative-num-draft-tokens {drafts + 1}"]


def model_card(recipe: dict, manifest: dict | None, table: str | None) -> str:
    target = recipe["target"]["name"]
    d = recipe["drafter"]
    kind = d.get("kind", "dflash")
    name = "DSpark" if kind == "dspark" else "DFlash"
    extra = (f" plus DSpark's low-rank Markov head (rank {d.get('markov_rank')}) and confidence head"
             if kind == "dspark" else "")
    lines = [
        "---",
        "library_name: transformers",
        f"tags: [{kind}, speculative-decoding, block-diffusion, drafter]",
        "---",
        f"# {name} drafter for {target}",
        "",
        f"A {d['num_hidden_layers']}-layer DFlash block-diffusion drafter (block size {d['block_size']}){extra} "
        f"trained with dflash-train for the target `{target}`. It has no embedding and no LM head: "
        "it uses the target's, so serve it with the same target weights.",
        "",
        "## Serving",
        "```",
        *_serving(target, kind, d["block_size"]),
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


def model_card_files(recipe: dict, manifest: dict | None, table: str | None) -> dict[str, str]:
    """{file name: text} written beside an exported drafter; ``table``: dflash-eval's, if evaluated."""
    files = {CARD: model_card(recipe, manifest, table), RECIPE: OmegaConf.to_yaml(recipe)}
    if manifest:
        files[MANIFEST] = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    return files
