"""``dflash-eval``: acceptance length, lossless check and speedup of a drafter on benchmarks.

    dflash-eval drafter_path=DIR datasets=[mtbench,humaneval] limit=20 max_new_tokens=256

Config: ``recipes/eval.yaml``. For each dataset every prompt goes through the target's
chat template, is decoded speculatively and plainly, and the two are compared. A prompt
with follow-up questions (MT-Bench's second turn) then asks each of them after the
target's own previous answer (the plain run's, greedy or sampled). Writes
``results.json`` and ``acceptance.png`` under ``output_dir`` and prints a table. Tokens/s
is new tokens over the wall time of whole generations (prefill included), summed over the
dataset's prompts; speedup is the ratio of the two rates. ``batch_size=N`` decodes N
prompts at once in both runs (throughput; 1, the default, gives latency numbers).
``runtime=static|dynamic|auto`` picks the decode loops of both runs (auto: static on a GPU).
``verify_tokens=k`` has the target verify only the first k drafts of each block (1 to
block size - 1; null, the default: all of them), as serving engines' shorter verify does.
``step_timing=true`` adds the speculative steps' draft / verify / bookkeeping time per step.
A drafter exported for other target weights than ``target.name``'s is refused (it would
reject nearly every draft); ``allow_other_target=true`` evaluates it anyway.
Settings are Hydra overrides of ``recipes/eval.yaml``: key=value, group=option (target=qwen3_8b).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import MISSING
from tqdm import tqdm

from dflash_train.atomic import atomic_write_text
from dflash_train.data.prompts import BUILTIN, HF_SCHEME, BenchmarkPrompt, load_benchmark
from dflash_train.config import DrafterConfig, TargetConfig
from dflash_train.errors import check_own_folder, check_writable_dir, run_command
from dflash_train.run_lock import hold_folder
from dflash_train.eval.acceptance import PromptResult, compare_prompt, summarize
from dflash_train.eval.batched import compare_batch
from dflash_train.eval.plot import model_name, plot_acceptance
from dflash_train.eval.report import format_table
from dflash_train.contract import check_kind
from dflash_train.model.dflash import check_sampling, check_verify_tokens
from dflash_train.recipe import HINT, load_command, log_to_stdout

RANDOM_DRAFTER = "random"
RUNTIMES = ("auto", "static", "dynamic")
WARMUP_TOKENS = 8
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


def _dataset_entries(cfg: EvalConfig) -> list[dict]:
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


def _load_prompts(entries: list[dict]) -> dict[str, tuple[str, list[BenchmarkPrompt]]]:
    """label -> (name, prompts). Done before any model loads so typos fail in a second."""
    out = {}
    for e in entries:
        options = {k: v for k, v in e.items() if k not in ("name", "label", "limit")}
        out[e["label"]] = (e["name"], load_benchmark(e["name"], limit=e["limit"], **options))
    return out


def _setup_drafter(cfg: EvalConfig, target):
    from dflash_train.model.init import kind_settings
    from dflash_train.model.kinds import KINDS

    dtype = target.model.dtype
    if cfg.drafter_path != RANDOM_DRAFTER:
        from dflash_train.model.io import check_target_weights, load_drafter
        from dflash_train.model.target import weights_digest

        drafter = load_drafter(cfg.drafter_path, target=target, dtype=dtype, device=cfg.device)
        if not cfg.allow_other_target:
            check_target_weights(drafter.config, weights_digest(cfg.target.name), "allow_other_target=true")
        return drafter
    torch.manual_seed(cfg.seed)  # the fresh drafter's weights are part of the run's identity
    d = cfg.drafter
    config_class, model_class = KINDS[check_kind(d.kind)]
    config = config_class.from_target(
        target.config,
        mask_token_id=cfg.target.mask_token_id,
        num_hidden_layers=d.num_hidden_layers,
        block_size=d.block_size,
        num_features=d.num_features,
        target_layer_ids=None if d.target_layer_ids is None else list(d.target_layer_ids),
        **kind_settings(d),
    )
    return model_class(config).to(device=cfg.device, dtype=dtype).eval()


def encode_prompt(tokenizer, prompt: BenchmarkPrompt, system_prompt: str | None, enable_thinking: bool) -> list[int]:
    """The prompt as the target sees it in chat: its template plus the assistant header."""
    return encode_messages(tokenizer, prompt.messages, system_prompt, enable_thinking)


def encode_messages(tokenizer, messages: list[dict], system_prompt: str | None, enable_thinking: bool) -> list[int]:
    """A chat ending with a user turn, templated and followed by the assistant header."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no chat template; use an instruct target")
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    # Templates ignore variables they do not use, so enable_thinking is safe to pass always.
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=enable_thinking)
    # The template already holds the special tokens (BOS, headers): do not add them twice.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _check_machine(cfg: EvalConfig) -> None:
    """What the values cannot tell: the drafter exists, the device does, the output is writable."""
    if cfg.drafter_path != RANDOM_DRAFTER and not Path(cfg.drafter_path).is_dir():
        raise ValueError(f"drafter_path {cfg.drafter_path!r} is not a directory (give a saved drafter or 'random')")
    if str(cfg.device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={cfg.device!r} but no CUDA GPU is available here (torch.cuda.is_available() "
                         "is False); use device=cpu")
    # The results are written after the whole evaluation: a user's folder or an unwritable
    # place fails now.
    check_own_folder(cfg.output_dir, "output_dir", "dflash-eval", (RESULTS_FILE, PLOT_FILE), _previous_results)
    check_writable_dir(cfg.output_dir, "output_dir")


def _previous_results(out: Path) -> bool:
    """Whether a results.json in ``out`` (if any) is one dflash-eval wrote: it is replaced."""
    if not (out / RESULTS_FILE).exists():
        return True
    try:
        report = json.loads((out / RESULTS_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(report, dict) and {"drafter", "target", "config", "datasets"} <= set(report)


def resolve_runtime(cfg: EvalConfig, target) -> bool:
    """Whether both runs use the static runtime (``runtime``: auto, static or dynamic)."""
    from dflash_train.model.runtime import use_static

    if cfg.runtime == "dynamic" or (cfg.runtime == "auto" and cfg.batch_size != 1):
        return False
    return use_static(True if cfg.runtime == "static" else None, target.model, cfg.device)


def setup(cfg: EvalConfig):
    """Everything a user can get wrong, checked before any decoding: raises ValueError.

    Returns label -> (dataset name, [(prompt, input ids (1, T))]), the target, the drafter,
    the stop token ids and the tokenizer (follow-up turns are templated during the run).
    """
    from dflash_train.model.target import load_target, load_tokenizer, stop_token_ids

    _check_machine(cfg)
    prompts = _load_prompts(_dataset_entries(cfg))
    target = load_target(cfg.target.name, dtype=cfg.dtype, device=cfg.device)
    tokenizer = load_tokenizer(cfg.target.name)
    drafter = _setup_drafter(cfg, target)
    drafter.compile_static_draft = cfg.compile_drafter
    check_verify_tokens(cfg.verify_tokens, drafter.drafts_per_block + 1)  # the bound is the drafts of a block
    resolve_runtime(cfg, target)  # runtime=static on a target it cannot serve fails here
    datasets = {}
    for label, (name, items) in prompts.items():
        encoded = [encode_prompt(tokenizer, p, cfg.system_prompt, cfg.enable_thinking) for p in items]
        datasets[label] = (name, [(p, torch.tensor([ids], device=cfg.device)) for p, ids in zip(items, encoded)])
    stops = stop_token_ids(tokenizer, getattr(target.model, "generation_config", None))
    return datasets, target, drafter, stops, tokenizer


def _compare(cfg: EvalConfig, drafter, target, prompt_ids: list[str], prompts: list[list[int]], max_new_tokens: int,
             stops: list[int], seed: int, turn: int = 1) -> list[PromptResult]:
    """One turn of several prompts: one by one (the latency numbers) or as one batch."""
    if cfg.batch_size == 1:
        static = resolve_runtime(cfg, target)
        return [compare_prompt(drafter, target.model, pid, torch.tensor([ids], device=target.device), max_new_tokens,
                               stops, cfg.temperature, seed, turn=turn, time_steps=cfg.step_timing, static=static,
                               verify_tokens=cfg.verify_tokens)
                for pid, ids in zip(prompt_ids, prompts)]
    return compare_batch(drafter, target.model, prompt_ids, prompts, max_new_tokens, stops, cfg.temperature, seed,
                         turn=turn, time_steps=cfg.step_timing, verify_tokens=cfg.verify_tokens)


def decode_conversations(cfg: EvalConfig, drafter, target, tokenizer, items: list[tuple[BenchmarkPrompt, torch.Tensor]],
                         stops: list[int], seed: int) -> list[PromptResult]:
    """Each prompt, then each of its follow-up questions (up to ``max_turns`` turns) after
    the target's own previous answer, the plain run's: both runs of a turn see the same
    chat. Results come prompt by prompt, turns in order."""
    return [r for rs in conversation_turns(cfg, drafter, target, tokenizer, items, stops, seed) for r in rs]


def conversation_turns(cfg: EvalConfig, drafter, target, tokenizer, items: list[tuple[BenchmarkPrompt, torch.Tensor]],
                       stops: list[int], seed: int) -> list[list[PromptResult]]:
    """`decode_conversations`, one list of turns per prompt."""
    limit = None if cfg.max_turns is None else cfg.max_turns - 1
    follow_ups = [p.follow_ups[:limit] for p, _ in items]
    chats = [list(p.messages) for p, _ in items]
    ids = [x[0].tolist() for _, x in items]
    results: list[list[PromptResult]] = [[] for _ in items]
    active, turn = list(range(len(items))), 1
    while active:
        for i in active if turn > 1 else []:
            answer = tokenizer.decode(results[i][-1].plain_ids, skip_special_tokens=True).strip()
            chats[i] += [{"role": "assistant", "content": answer}, {"role": "user", "content": follow_ups[i][turn - 2]}]
            ids[i] = encode_messages(tokenizer, chats[i], cfg.system_prompt, cfg.enable_thinking)
        outs = _compare(cfg, drafter, target, [items[i][0].id for i in active], [ids[i] for i in active],
                        cfg.max_new_tokens, stops, seed, turn)
        for i, r in zip(active, outs):
            results[i].append(r)
        turn += 1
        active = [i for i in active if len(follow_ups[i]) >= turn - 1]
    return results


def decode_datasets(cfg: EvalConfig, drafter, target, tokenizer, datasets, stops: list[int],
                    progress=None) -> dict[str, list[PromptResult]]:
    """label -> its prompts' results. Batches of ``batch_size`` prompts are cut from all the
    datasets in order, so one batch may hold several datasets' prompts: at batch sizes above
    a dataset's size that means fewer and fuller decode loops (a GPU's batched step costs
    about the same whatever the batch). Each row still decodes exactly as alone; its time is
    its batch's split evenly, so a dataset's tokens/s is its rows' share of the batches.
    ``progress(done, results)`` is called after each batch."""
    pairs = [(label, item) for label, (_, items) in datasets.items() for item in items]
    results: dict[str, list[PromptResult]] = {label: [] for label in datasets}
    for start in range(0, len(pairs), cfg.batch_size):
        batch = pairs[start : start + cfg.batch_size]
        turns = conversation_turns(cfg, drafter, target, tokenizer, [item for _, item in batch], stops,
                                   cfg.seed + start)
        for (label, _), rs in zip(batch, turns):
            results[label] += rs
        if progress is not None:
            progress(len(batch), results)
    return results


def evaluate(cfg: EvalConfig, datasets, target, drafter, stops: list[int], tokenizer) -> dict:
    """Decode every prompt both ways; write results.json and acceptance.png; print the table."""
    block_size = drafter.config.block_size
    width = drafter.drafts_per_block + 1  # the widest verify: B for DFlash, B + 1 for DSpark
    # Warm both paths once so one-time costs (allocator growth, kernel selection) stay
    # out of the first timed prompt.
    first = next(iter(datasets.values()))[1][: cfg.batch_size]
    _compare(cfg, drafter, target, [p.id for p, _ in first], [x[0].tolist() for _, x in first], WARMUP_TOKENS, stops,
             cfg.seed)

    runtime = "static" if resolve_runtime(cfg, target) else "dynamic"
    verify_tokens = check_verify_tokens(cfg.verify_tokens, width)
    report = {"target": cfg.target.name, "drafter": cfg.drafter_path, "block_size": block_size, "runtime": runtime,
              "verify_tokens": verify_tokens, "config": asdict(cfg), "datasets": {}}
    summaries = {}
    bar = tqdm(total=sum(len(items) for _, items in datasets.values()), desc=",".join(datasets), unit="prompt",
               file=sys.stderr)

    def progress(done, results):
        steps = [n for rs in results.values() for r in rs for n in r.acceptance_lengths]
        bar.update(done)
        bar.set_postfix(tau=f"{sum(steps) / max(len(steps), 1):.2f}")

    decoded = decode_datasets(cfg, drafter, target, tokenizer, datasets, stops, progress)
    bar.close()
    for label, (name, _) in datasets.items():
        results = decoded[label]
        summaries[label] = {**summarize(results, width, greedy=cfg.temperature == 0),
                            "temperature": cfg.temperature, "batch_size": cfg.batch_size, "runtime": runtime,
                            "device": str(cfg.device)}  # on a CPU the table gives the speedup beside the GPU's
        report["datasets"][label] = {"source": name, **summaries[label], "prompts": [r.to_dict() for r in results]}

    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    plot_acceptance(summaries, out / PLOT_FILE, title=f"{Path(cfg.drafter_path).name} on {model_name(cfg.target.name)}")
    # written last and renamed into place: a results.json on disk is always complete
    atomic_write_text(out / RESULTS_FILE, json.dumps(report, indent=2) + "\n")
    print(format_table(summaries))
    print(f"wrote {out / RESULTS_FILE}")
    print(f"wrote {out / PLOT_FILE}")  # a line each: two long paths on one line passed 200 characters
    return report


def load(argv: list[str] | None = None) -> EvalConfig:
    """The validated settings of a command line; loads nothing."""
    return load_command(EvalConfig, argv, "eval", __doc__, validate)


def run(argv: list[str] | None = None) -> dict:
    cfg = load(argv)
    with hold_folder(cfg.output_dir, "output_dir", "dflash-eval"):
        return evaluate(cfg, *setup(cfg))


def main(argv: list[str] | None = None) -> None:
    log_to_stdout()
    # A user mistake or a refusal of the machine: one readable line and a non-zero exit.
    run_command("dflash-eval", run, argv)


if __name__ == "__main__":
    main()
