"""Tiny but real training inputs for the trainer tests: dflash-datagen directories built from
chat-templated conversations, and a small random target saved as a model directory."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_train.atomic import atomic_write_text
from dflash_train.data import format as data_format

# Short assistant answers with repeated structure, so a drafter can learn them in a few steps.
CONVERSATIONS = [
    ("What is the capital of France?", "The capital of France is Paris. Paris is also the largest city in France."),
    ("Count from one to ten.", "One, two, three, four, five, six, seven, eight, nine, ten."),
    ("Name three primary colors.", "The three primary colors are red, blue and yellow."),
    ("What is 2 + 2?", "2 + 2 = 4. Two plus two equals four."),
    ("Say hello in French.", "Hello in French is bonjour. You can also say salut to friends."),
    ("List the days of the week.", "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday."),
    ("What color is the sky?", "On a clear day the sky is blue. At sunset it can turn orange and red."),
    ("Write a Python function that adds two numbers.", "def add(a, b):\n    return a + b"),
]


def chat_row(tokenizer, question: str, answer: str, index: int) -> dict:
    """One datagen row: the templated conversation with loss_mask 1 on the assistant reply."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                           add_generation_prompt=True)
    full = tokenizer.apply_chat_template([{"role": "user", "content": question},
                                          {"role": "assistant", "content": answer}], tokenize=False)
    assert full.startswith(prompt)
    p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    assert ids[: len(p_ids)] == p_ids
    return {"input_ids": ids, "loss_mask": [0] * len(p_ids) + [1] * (len(ids) - len(p_ids)),
            "prompt_id": f"p{index}", "source": "test", "finish_reason": "stop", "prompt_len": len(p_ids),
            "response_len": len(ids) - len(p_ids), "num_tokens": len(ids)}


def write_datagen_dir(out_dir: Path, target_spec: str, tokenizer, repeat: int = 1,
                      rows: list[dict] | None = None) -> Path:
    """A finished dflash-datagen output (manifest + data/) for ``target_spec``."""
    from dflash_train.model.target import target_identity, tokenizer_hash, tokenizer_identity

    if rows is None:
        pairs = CONVERSATIONS * repeat
        rows = [chat_row(tokenizer, q, a, i) for i, (q, a) in enumerate(pairs)]
    manifest = {"format_version": data_format.FORMAT_VERSION, "target": target_identity(target_spec),
                "tokenizer": tokenizer_identity(tokenizer), "tokenizer_hash": tokenizer_hash(tokenizer),
                "counts": {"rows": len(rows)}}
    out_dir = Path(out_dir)
    data_format.check_run(out_dir, {})  # as dflash-datagen does first: the folder is a run of its own
    if rows:
        data_format.write_shard(out_dir, 0, rows, {})
        data_format.consolidate(out_dir, range(1), manifest)
    else:  # consolidate cannot save an empty table (datasets needs num_shards=1 for that)
        import datasets
        import pyarrow as pa

        empty = datasets.Dataset(pa.Table.from_pylist([], schema=data_format.SCHEMA))
        empty.save_to_disk(str(out_dir / "data"), num_shards=1)
        atomic_write_text(out_dir / "manifest.json", json.dumps(manifest))
    return out_dir


def save_tiny_target(out_dir: Path, tokenizer, layers: int = 6, seed: int = 0) -> str:
    """A random Llama with the tokenizer's vocabulary, saved as a local model directory."""
    from tests.conftest import make_tiny_target

    model = make_tiny_target("llama", vocab=len(tokenizer), layers=layers, seed=seed)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return str(out_dir)


def tiny_train_config(target_dir: str, data_dir: Path, output_dir: Path, **overrides):
    """A validated TrainConfig for the tiny target: 1 drafter layer, blocks of 4, CPU, dense masks."""
    from omegaconf import OmegaConf

    from dflash_train.config import to_train_config

    base = {
        "target": {"name": target_dir, "mask_token_id": 16, "num_layers": 6},
        "drafter": {"num_hidden_layers": 1, "block_size": 8, "attention": "dense", "compile": False},
        "data": {"path": str(data_dir), "num_anchors": 6, "max_length": 64},
        "optim": {"lr": 3e-3, "micro_batch_size": 2, "grad_accum_steps": 2},
        "logging": {"every": 1, "wandb": "disabled", "progress_bar": False},
        "checkpoint": {"every": 0},
        "backend": {"name": "single", "device": "cpu"},
        "epochs": 2,
        "export": False,
        "output_dir": str(output_dir),
    }
    return to_train_config(OmegaConf.merge(OmegaConf.create(base), OmegaConf.create(overrides)))


def tiny_train_args(target_dir: str, data_dir: Path, output_dir: Path, *overrides: str) -> list[str]:
    """The dflash-train command-line overrides of ``tiny_train_config`` (for subprocess runs)."""
    return [f"target.name={target_dir}", "target.num_layers=6", "target.mask_token_id=16",
            "drafter.num_hidden_layers=1", "drafter.block_size=8", "drafter.attention=dense", "drafter.compile=false",
            f"data.path={data_dir}", "data.num_anchors=6", "data.max_length=64", "optim.lr=3e-3",
            "optim.micro_batch_size=2", "optim.grad_accum_steps=2", "logging.every=1", "logging.wandb=disabled",
            "logging.progress_bar=false", "checkpoint.every=0", "backend=single", "backend.device=cpu", "epochs=2",
            "export=false", f"output_dir={output_dir}", *overrides]


def tiny_inputs(root: Path) -> dict:
    """The trainer tests' usual inputs under ``root``: the SmolLM2 tokenizer, a tiny random
    Llama target saved with it, and a datagen folder of the 8 conversations for it."""
    from dflash_train.model.target import load_tokenizer
    from tests.conftest import SMOLLM2

    tok = load_tokenizer(SMOLLM2)
    target = save_tiny_target(root / "target", tok)
    return {"root": root, "tok": tok, "target": target, "data": write_datagen_dir(root / "data", target, tok)}
