"""dflash-eval's settings and the checks that need only them and the file system.

Nothing here imports torch: dflash-eval (eval/cli.py) and eval.speed refuse a mistake in
the settings, a drafter_path that is no drafter folder, a user's output_dir or an unknown
dataset in a second, before eval/job.py loads a model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from dflash_train.config import DrafterConfig, TargetConfig
from dflash_train.contract_base import check_kind, drafts_per_block
from dflash_train.data.prompts import BUILTIN, HF_SCHEME, BenchmarkPrompt, load_benchmark
from dflash_train.errors import check_own_folder, check_writable_dir
from dflash_train.model.files import read_raw_config, weight_files
from dflash_train.model.runtime_checks import check_sampling, check_verify_tokens
from dflash_train.recipe import HINT

RANDOM_DRAFTER = "random"
RUNTIMES = ("auto", "static", "dynamic")
DATASET_KEYS = {"name", "label", "limit", "column", "subset"}
RESULTS_FILE, PLOT_FILE = "results.json", "acceptance.png"


@dataclass
class EvalConfig:
    """Every setting of dflash-eval; recipes/eval.yaml says what each one does."""

    target: TargetConfig = field(default_factory=TargetConfig)  # the group training uses
    drafter: DrafterConfig = field(default_factory=DrafterConfig)  # shape of a fresh (random) drafter
    drafter_path: str = field(default=MISSING, metadata={HINT: f"<drafter directory> or {RANDOM_DRAFTER}"})
    datasets: list[Any] = field(default_factory=lambda: ["mtbench", "humaneval"])  # names or mappings
    limit: int | None = 20
    max_new_tokens: int = 256
    temperature: float = 0.0
    max_turns: int | None = None
    batch_size: int = 1
    runtime: str = "auto"  # auto | static | dynamic (auto: static on a GPU at batch_size=1)
    verify_tokens: int | None = None  # drafts verified per step, 1..block_size-1; None: the whole block
    step_timing: bool = False
    compile_drafter: bool = False  # static runtime on a GPU: the draft step compiled inside its graphs
    enable_thinking: bool = False
    system_prompt: str | None = None
    output_dir: str = "eval_results"
    seed: int = 0
    device: str = "cpu"
    dtype: str = "auto"
    allow_other_target: bool = False  # evaluate a drafter exported for other target weights


def validate(cfg: EvalConfig, static_batches: bool = False) -> None:
    """Checks of the values alone; each error names the offending value. ``static_batches``:
    the caller decodes batches on the static runtime (eval.speed does; dflash-eval does not)."""
    if not cfg.drafter_path:
        raise ValueError(f"drafter_path='': set drafter_path=<drafter directory> or drafter_path={RANDOM_DRAFTER}")
    if cfg.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {cfg.max_new_tokens}")
    check_sampling(cfg.temperature)
    if cfg.batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {cfg.batch_size}")
    if cfg.max_turns is not None and cfg.max_turns < 1:
        raise ValueError(f"max_turns must be >= 1 or null (every turn), got {cfg.max_turns}")
    if cfg.verify_tokens is not None and (isinstance(cfg.verify_tokens, bool) or cfg.verify_tokens < 1):
        raise ValueError(f"verify_tokens={cfg.verify_tokens}: must be >= 1 (and below the drafter's block size), "
                         "or null for the whole block")
    check_kind(cfg.drafter.kind)
    if cfg.runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {list(RUNTIMES)}, got {cfg.runtime!r}")
    if cfg.runtime == "static" and cfg.batch_size != 1 and not static_batches:
        raise ValueError(f"runtime=static decodes one prompt at a time but batch_size={cfg.batch_size}; use "
                         "batch_size=1 or runtime=dynamic (python -m dflash_train.eval.speed measures static batches)")


def dataset_entries(cfg: EvalConfig) -> list[dict]:
    """Normalise ``datasets`` entries to dicts with a unique ``label``."""
    raw = cfg.datasets
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"datasets must be a non-empty list, got {raw!r}")
    entries = []
    for item in raw:
        entry = {"name": item} if isinstance(item, str) else dict(item) if isinstance(item, dict) else None
        if entry is None or not isinstance(entry.get("name"), str) or set(entry) - DATASET_KEYS:
            raise ValueError(f"datasets entry {item!r}: expected a name or a mapping with keys {sorted(DATASET_KEYS)}")
        name = entry["name"]
        is_file = name not in BUILTIN and not name.startswith(HF_SCHEME)
        default_label = Path(name).name.split(".")[0] if is_file else name
        entry.setdefault("label", default_label)
        entry.setdefault("limit", cfg.limit)
        entries.append(entry)
    labels = [e["label"] for e in entries]
    if len(set(labels)) != len(labels):
        raise ValueError(f"dataset labels must be unique, got {labels}; set 'label' on repeated entries")
    return entries


def load_prompts(entries: list[dict]) -> dict[str, tuple[str, list[BenchmarkPrompt]]]:
    """label -> (name, prompts). Done before any model loads so typos fail in a second."""
    out = {}
    for e in entries:
        options = {k: v for k, v in e.items() if k not in ("name", "label", "limit")}
        out[e["label"]] = (e["name"], load_benchmark(e["name"], limit=e["limit"], **options))
    return out


def check_inputs(cfg: EvalConfig) -> dict[str, tuple[str, list[BenchmarkPrompt]]]:
    """What the values alone cannot tell, short of loading a model: the drafter folder holds a
    drafter's config and weights, a fresh drafter's block takes verify_tokens, the output is
    writable and not a user's folder, the datasets exist. Returns their prompts
    (``load_prompts``)."""
    if cfg.drafter_path == RANDOM_DRAFTER:
        check_verify_tokens(cfg.verify_tokens, drafts_per_block(cfg.drafter.kind, cfg.drafter.block_size) + 1)
    else:
        drafter = Path(cfg.drafter_path)
        if not drafter.is_dir():
            raise ValueError(f"drafter_path {cfg.drafter_path!r} is not a directory (give a saved drafter or 'random')")
        read_raw_config(drafter)
        weight_files(drafter)
    # The results are written after the whole evaluation: a user's folder or an unwritable
    # place fails now.
    check_own_folder(cfg.output_dir, "output_dir", "dflash-eval", (RESULTS_FILE, PLOT_FILE), _previous_results)
    check_writable_dir(cfg.output_dir, "output_dir")
    return load_prompts(dataset_entries(cfg))


def _previous_results(out: Path) -> bool:
    """Whether a results.json in ``out`` (if any) is one dflash-eval wrote: it is replaced."""
    if not (out / RESULTS_FILE).exists():
        return True
    try:
        report = json.loads((out / RESULTS_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(report, dict) and {"drafter", "target", "config", "datasets"} <= set(report)


