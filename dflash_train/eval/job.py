"""dflash-eval's work: load the target and the drafter, decode every prompt both ways, write
the results.

eval/cli.py reads the command line and imports this module only once the settings and
inputs passed eval/settings.py's checks, so a mistake in them is refused without torch.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from dflash_train.atomic import atomic_write_text
from dflash_train.contract import check_kind
from dflash_train.data.prompts import BenchmarkPrompt
from dflash_train.eval.acceptance import PromptResult, compare_prompt, summarize
from dflash_train.eval.batched import compare_batch
from dflash_train.eval.plot import model_name, plot_acceptance
from dflash_train.eval.report import format_table
from dflash_train.eval.settings import PLOT_FILE, RANDOM_DRAFTER, RESULTS_FILE, EvalConfig, check_inputs
from dflash_train.model.runtime_checks import check_verify_tokens

WARMUP_TOKENS = 8


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


def check_device(cfg: EvalConfig) -> None:
    if str(cfg.device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={cfg.device!r} but no CUDA GPU is available here (torch.cuda.is_available() "
                         "is False); use device=cpu")


def resolve_runtime(cfg: EvalConfig, target) -> bool:
    """Whether both runs use the static runtime (``runtime``: auto, static or dynamic)."""
    from dflash_train.model.runtime import use_static

    if cfg.runtime == "dynamic" or (cfg.runtime == "auto" and cfg.batch_size != 1):
        return False
    return use_static(True if cfg.runtime == "static" else None, target.model, cfg.device)


def setup(cfg: EvalConfig, prompts: dict | None = None):
    """Everything a user can get wrong, checked before any decoding: raises ValueError.
    ``prompts``: what settings.check_inputs returned (dflash-eval runs it before importing
    torch); None runs it here.

    Returns label -> (dataset name, [(prompt, input ids (1, T))]), the target, the drafter,
    the stop token ids and the tokenizer (follow-up turns are templated during the run).
    """
    from dflash_train.model.target import load_target, load_tokenizer, stop_token_ids

    if prompts is None:
        prompts = check_inputs(cfg)
    check_device(cfg)
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
