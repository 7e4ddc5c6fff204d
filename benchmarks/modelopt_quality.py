#!/usr/bin/env python3
"""Model-Optimizer's DFlash drafter on our data for a wall-clock budget, scored by our evaluation.

    PYTHONPATH=/tmp/site:/tmp/site_mo python3 -m benchmarks.modelopt_quality target=qwen25_coder_05b \\
        target.name=/tmp/qwen25coder05b.gguf data.path=/tmp/data/sharegpt-qwen25-coder-05b budget_min=20 \\
        run_dir=/tmp/mo20 'train=["+experiment=qwen25_coder_05b_1xh100"]' 'eval=["batch_size=120"]' \\
        'datasets=[mtbench,humaneval,benchmarks/quality-h100-2026-11-24/sharegpt-heldout.jsonl]'

The other side of dflash-quality (issue 27): the same target, rows, loss masks and held-out
split, the same minutes on one GPU, the same evaluation; what differs is the trainer. It takes
dflash-quality's settings (recipes/quality.yaml, key=value; the same command line works for
both) and two of its own, modelopt.seq_len (4096) and modelopt.bf16 (true):
  1. Our recipe (recipes/train.yaml with target=..., every target.KEY=VALUE and train=[...], as
     dflash-quality composes its train stage) fixes the target, the drafter geometry (layers,
     block, target layer ids, mask token), the anchors, the seed and the held-out rows.
  2. Model-Optimizer 0.47 trains its own drafter as its DFlash recipe
     (modelopt_recipes/general/speculative_decoding/dflash.yaml and examples/speculative_decoding/
     main.py) does, with our geometry: mtsp.convert(target, [("dflash", cfg)]) on the target in
     target.dtype (bf16 on a GPU, what main.py's dtype="auto" gives; float32 on a CPU), self-logit
     distillation, D-PACE position weights (the library's default objective, alpha 0.5), one
     conversation per step right-padded to training_seq_len (modelopt.seq_len, 4096) with labels
     on the assistant tokens only (answer_only_loss); the HF Trainer's step: bf16 autocast
     (modelopt.bf16), AdamW lr 6e-4 with weight decay 0 (fused on CUDA), gradient clipping at
     1.0, a linear schedule after 100 warm-up steps, a fresh drafter (its recipe's). The
     schedule ends where the budget does, as max_steps makes HF's do: the seconds per step of
     the first probe_steps steps, the first warmup_steps left out, fix the last step (they are
     steps of the run itself, inside the warm-up, so nothing is wasted), refitted every 100
     steps to the latest speed up to the schedule's middle (refit_due).
  3. The budget runs from the script's start (loading the target included), like dflash-quality's
     train stage; Model-Optimizer's own export_speculative_decoding then writes the drafter.
  4. A check that our loader reads the export as Model-Optimizer's drafter: the drafts of one
     block after 4 training rows, its pseudo_speculative_generate against our drafter read from
     the export (the share of equal drafts, logged and kept in train.json; 1.0 on the CPU).
  5. Our evaluation reads that export through model/foreign.py: dflash-train's held-out expected
     tau and tau counted block by block on the held-out rows (Trainer.validate,
     drafter.init_from=<export>) and dflash-eval
     exactly as dflash-quality's eval stage runs it (datasets, limit, max_new_tokens, device,
     eval=[...]).
Prints dflash-quality's table; writes <run_dir>/quality.json and <run_dir>/metrics.jsonl. A
finished stage (training and export, held-out tau, dflash-eval) is reused when the same
command runs again; other settings in the same run_dir are refused. Without a CUDA GPU it
trains on the CPU (our recipe gets dense masks, as dflash-quality's train stage does).
dflash-quality's datagen stage and its seconds_per_step/startup_s (dflash-train's timings)
have no meaning here and are refused.

Run it from the repository root with -m (this checkout's dflash_train, as dflash-quality's stages
get). Needs nvidia-modelopt 0.47.0 and the wheels of ../shared/anchors/modelopt/wheels.txt except
omegaconf 2.4 (Hydra needs 2.3; the DFlash path runs on 2.3), installed into their own --target
folder that comes after ours on PYTHONPATH; Model-Optimizer also imports scipy.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

RECIPE_DEFAULTS = {  # modelopt_recipes/general/speculative_decoding/dflash.yaml, 0.47.0
    "lr": 6e-4, "warmup_steps": 100, "weight_decay": 0.0, "max_grad_norm": 1.0, "seq_len": 4096,
}
IGNORE_TOKEN_ID = -100  # HF's label for "no loss here"
PROG = "modelopt_quality"
OPTION_PREFIX = "modelopt."  # this script's own settings; every other one is dflash-quality's
# This script's flags before it took dflash-quality's settings: refused, naming what replaced each.
RETIRED_FLAGS = {"--data": "data.path=DIR", "--budget-min": "budget_min=MINUTES", "--run-dir": "run_dir=DIR",
                 "--target": "target=NAME", "--experiment": 'train=["+experiment=NAME"]',
                 "--set": "target.KEY=VALUE (our recipe and dflash-eval) or train=[...] (our recipe)",
                 "--val-rows": "data.val_rows=N", "--seq-len": "modelopt.seq_len=N",
                 "--probe-steps": "probe_steps=N", "--device": "device=DEVICE",
                 "--eval": "nothing (the evaluation always runs)", "--limit": "limit=N",
                 "--max-new-tokens": "max_new_tokens=N", "--eval-set": 'eval=["KEY=VALUE"]'}
AGREEMENT_PROMPT, AGREEMENT_ROWS = 64, 4  # the export check: a block after 64 tokens of 4 training rows
MIN_AGREEMENT = 0.8  # below this share of equal drafts, the export or our reading of it is wrong
RUN_FILE, TRAIN_FILE, HELD_OUT_FILE, EVAL_TIME_FILE = "run.json", "train.json", "heldout.json", "eval_seconds.json"
OWN_FILES = (RUN_FILE, TRAIN_FILE, HELD_OUT_FILE, EVAL_TIME_FILE, "quality.json", "metrics.jsonl", "export/*",
             "heldout/*", "eval/*")


@dataclass
class ModeloptOptions:
    """modelopt.KEY=VALUE: Model-Optimizer's side, beyond dflash-quality's settings."""

    seq_len: int = RECIPE_DEFAULTS["seq_len"]  # training_seq_len: every row right-padded (or cut) to it
    bf16: bool = True  # training.bf16: the step under bf16 autocast; false on a CPU without bf16 instructions


def log(msg: str) -> None:
    print(f"[modelopt-quality] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ the command line
def load(argv: list[str]):
    """(dflash-quality's validated QualityRun, ModeloptOptions) of a command line."""
    from omegaconf import OmegaConf

    from dflash_train import quality
    from dflash_train.recipe import HELP_FLAGS, to_config

    for arg in argv:
        if arg in HELP_FLAGS:
            print(__doc__)
            sys.exit(0)
        flag = arg.partition("=")[0]
        if flag in RETIRED_FLAGS:
            raise ValueError(f"{flag} is no longer accepted; use {RETIRED_FLAGS[flag]}")
    ours = [a[len(OPTION_PREFIX):] for a in argv if a.startswith(OPTION_PREFIX)]
    run = quality.load([a for a in argv if not a.startswith(OPTION_PREFIX)])
    options = to_config(ModeloptOptions, OmegaConf.from_dotlist(ours), prefix=OPTION_PREFIX.rstrip("."))
    check_settings(run.cfg, options)
    return run, options


def check_settings(cfg, options: ModeloptOptions) -> None:
    """dflash-quality's settings this trainer cannot honour, and its own bad values."""
    if cfg.datagen_budget_min is not None:
        raise ValueError(f"datagen_budget_min={cfg.datagen_budget_min:g}: this comparison trains on a given data set; "
                         "give data.path=DIR (a dflash-datagen output, the one dflash-quality trains on)")
    if cfg.seconds_per_step is not None or cfg.startup_s:
        raise ValueError(f"seconds_per_step={cfg.seconds_per_step} startup_s={cfg.startup_s:g} are dflash-train's "
                         "timings; Model-Optimizer's steps are timed in the run itself (probe_steps, warmup_steps)")
    extras = [f"{key}={getattr(cfg, key):g}" for key in ("validation_s", "checkpoint_s", "export_s")
              if getattr(cfg, key)]
    if extras:
        raise ValueError(f"{' '.join(extras)}: dflash-train's timings for dflash-quality's plan; this comparison "
                         "times its own steps in the run itself")
    if cfg.data.val_rows < 1:
        raise ValueError(f"data.val_rows={cfg.data.val_rows}: the held-out expected tau needs at least one held-out row")
    if options.seq_len < 1:
        raise ValueError(f"modelopt.seq_len={options.seq_len} must be a positive number of tokens")


def padded_length(seq_len: int, block_size: int) -> int:
    """training_seq_len rounded up to whole blocks (Model-Optimizer refuses anything else)."""
    return math.ceil(seq_len / block_size) * block_size


def settings(run, options: ModeloptOptions) -> dict:
    """What the stages depend on: dflash-quality's settings and ours (modelopt.KEY)."""
    from dflash_train import quality

    ours = {f"{OPTION_PREFIX}{k}": v for k, v in dataclasses.asdict(options).items()}
    return {**quality.settings(run), **ours}


def check_run_dir(run_dir: Path, now: dict) -> None:
    """Refuse a run_dir with another run's files or other settings; record these settings."""
    from dflash_train.errors import check_own_folder, check_writable_dir, folder_writer
    from dflash_train.quality import settings_changes

    check_own_folder(run_dir, "run_dir", PROG, OWN_FILES, lambda folder: folder_writer(folder) == PROG)
    path = run_dir / RUN_FILE
    before = json.loads(path.read_text())["settings"] if path.exists() else now
    changed = settings_changes(before, now)
    if changed:
        raise ValueError(f"run_dir {str(run_dir)!r} holds a run with other settings ({'; '.join(changed)}): rerun "
                         "with its settings to finish it, or use a new run_dir")
    check_writable_dir(run_dir, "run_dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"written_by": PROG, "settings": now}, indent=2))


# ------------------------------------------------------------------ our recipe and data
def our_overrides(run, machine: list[str], output_dir: Path, init_from: Path | None = None) -> list[str]:
    """dflash-train's overrides in dflash-quality's train-stage order: this machine's defaults,
    the command line's target keys, train=[...], then what this script fixes."""
    from dflash_train.recipe import quote_value

    overrides = [f"target={run.target_recipe}", f"data.path={quote_value(run.data_path)}", *machine,
                 *run.target_overrides, *run.cfg.train, f"output_dir={quote_value(str(output_dir))}",
                 f"data.val_rows={run.cfg.data.val_rows}",
                 "logging.wandb=disabled", "logging.progress_bar=false", "export=false", "checkpoint.every=0",
                 "checkpoint.resume=false"]
    if init_from is not None:  # evaluation: the recipe's own validation, every weight from the export
        overrides += [f"drafter.init_from={quote_value(str(init_from))}", "drafter.init_from_target=false"]
    return overrides


def our_config(overrides: list[str]):
    """dflash-train's validated config of those overrides."""
    from dflash_train.config import TrainConfig, to_train_config
    from dflash_train.recipe import compose_recipe

    return to_train_config(compose_recipe(TrainConfig, "train", overrides))


def training_rows(cfg):
    """(dataset, the training row ids): dflash-train's split of the same rows, the manifest
    checked against the target first (as the trainer does)."""
    from dflash_train.data.format import check_target, load_generated, read_manifest
    from dflash_train.model.target import load_tokenizer, target_identity, tokenizer_hash, tokenizer_identity
    from dflash_train.training.trainer import split_validation

    if cfg.data.check_manifest:
        tokenizer = load_tokenizer(cfg.target.name)
        check_target(read_manifest(cfg.data.path), target_identity(cfg.target.name), tokenizer_identity(tokenizer),
                     tokenizer_hash(tokenizer))
    ds = load_generated(cfg.data.path)
    train, _ = split_validation(len(ds), cfg.data.val_rows, cfg.seed)
    return ds, train


def modelopt_batch(row: dict, max_length: int, seq_len: int, pad_id: int, device) -> dict:
    """One conversation as Model-Optimizer's LanguageDataCollator hands it over: cut to our
    data.max_length and to training_seq_len, right-padded to training_seq_len, labels = the ids
    on assistant tokens (our loss mask) and -100 elsewhere."""
    keep = min(max_length, seq_len)
    ids, mask = list(row["input_ids"][:keep]), list(row["loss_mask"][:keep])
    pad = seq_len - len(ids)
    input_ids = torch.tensor([ids + [pad_id] * pad], device=device)
    attention = torch.tensor([[1] * len(ids) + [0] * pad], device=device)
    labels = torch.tensor([[t if m else IGNORE_TOKEN_ID for t, m in zip(ids, mask)] + [IGNORE_TOKEN_ID] * pad],
                          device=device)
    return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}


# ------------------------------------------------------------------ Model-Optimizer's side
def dflash_settings(cfg, target_config) -> dict:
    """The DFlash recipe's settings with our geometry (mtsp.convert's config)."""
    from dflash_train.model.dflash import default_target_layer_ids, rope_parameters

    d, t = cfg.drafter, target_config
    ids = list(d.target_layer_ids or default_target_layer_ids(t.num_hidden_layers, d.num_features or d.num_hidden_layers))
    if len(ids) != d.num_hidden_layers:
        raise ValueError(f"Model-Optimizer needs one target layer per draft layer; the recipe has {len(ids)} features "
                         f"({ids}) for drafter.num_hidden_layers={d.num_hidden_layers}")
    heads = t.num_attention_heads
    # Every geometry field explicitly: modelopt builds Qwen3Config(**this), whose own defaults
    # (intermediate 22016, 32 kv heads, RoPE 1e4) would win over the target's otherwise.
    arch = dict(num_hidden_layers=d.num_hidden_layers, target_layer_ids=ids, hidden_size=t.hidden_size,
                intermediate_size=t.intermediate_size, num_attention_heads=heads,
                num_key_value_heads=getattr(t, "num_key_value_heads", None) or heads,
                head_dim=getattr(t, "head_dim", None) or t.hidden_size // heads, rms_norm_eps=t.rms_norm_eps,
                max_position_embeddings=t.max_position_embeddings, rope_theta=rope_parameters(t)["rope_theta"])
    return dict(dflash_block_size=d.block_size, dflash_num_anchors=cfg.data.num_anchors,
                dflash_loss_objective="dpace", dflash_dpace_alpha=0.5, dflash_self_logit_distillation=True,
                dflash_loss_decay_factor=4.0, dflash_freeze_base_model=True, dflash_use_torch_compile=False,
                dflash_draft_attention="bidirectional", dflash_mask_token_id=cfg.target.mask_token_id,
                dflash_architecture_config=arch)


def build_modelopt(cfg, device):
    """The target loaded as examples/speculative_decoding/main.py loads it, converted to DFlash."""
    import modelopt
    import modelopt.torch.speculative as mtsp
    import modelopt.torch.speculative.plugins.hf_dflash  # noqa: F401  (its plugin import fails silently otherwise)
    from transformers import AutoModelForCausalLM

    from dflash_train.model.target import resolve_target, target_dtype

    # main.py's dtype="auto" is the folder's bf16 on a GPU; target.dtype (auto: float32 on a CPU)
    # gives the target the dtype our trainer gives it on either machine.
    dtype = target_dtype(cfg.target.dtype, device)
    model = AutoModelForCausalLM.from_pretrained(resolve_target(cfg.target.name), dtype=dtype)
    settings = dflash_settings(cfg, model.config)
    model = mtsp.convert(model, [("dflash", settings)])
    build_rotary(model)
    model = model.to(device)
    dc = model.dflash_config
    log(f"modelopt {modelopt.__version__}: target {model.dtype}, draft layers {dc.num_hidden_layers}, inter "
        f"{dc.intermediate_size}, heads {dc.num_attention_heads}/{dc.num_key_value_heads}, head_dim {dc.head_dim}, "
        f"target_layer_ids {model.target_layer_ids}, block {model.dflash_block_size}, mask {model.mask_token_id}, "
        f"objective {model.dflash_loss_objective}, distillation {model.dflash_self_logit_distillation}")
    arch = settings["dflash_architecture_config"]
    assert list(model.target_layer_ids) == arch["target_layer_ids"] and dc.intermediate_size == arch["intermediate_size"]
    return model


def build_rotary(model) -> None:
    """The drafter's rotary embedding, built before its first forward: Model-Optimizer 0.47
    builds it there with ``device=``, which transformers 5.18 removed (5.17, the GPU image's,
    accepts both); the same class and config, so the same RoPE."""
    import inspect

    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding  # the class its drafter uses

    if "device" not in inspect.signature(Qwen3RotaryEmbedding.__init__).parameters:
        model.dflash_module.rotary_emb = Qwen3RotaryEmbedding(config=model.dflash_config)


class BudgetSchedule:
    """HF's linear schedule with warm-up (get_linear_schedule_with_warmup) whose last step is
    set once the first steps are timed: the learning rate reaches zero when the budget ends."""

    def __init__(self, warmup: int):
        self.warmup, self.total = warmup, None

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return step / max(1, self.warmup)
        if self.total is None:
            return 1.0
        return max(0.0, (self.total - step) / max(1, self.total - self.warmup))


def last_step(step: int, budget_s: float, elapsed_s: float, per_step: float) -> int:
    """The schedule's last step: this one and as many more as the rest of the budget holds."""
    return step + max(1, int((budget_s - elapsed_s) / per_step))


REFIT_EVERY = 100  # steps between refits of the schedule's end to the measured speed


def refit_due(step: int, probe: int, total: int | None) -> bool:
    """Whether the schedule's end is refitted after this step: every REFIT_EVERY steps after the
    probe, up to the middle of the schedule. The first steps of a run are slower than the rest
    (on one H100, 0.40 s a step over steps 3-8, 0.18 s from step 100), so an end fixed at the
    probe alone stopped a 5-minute run after 2.4 minutes."""
    return total is not None and step > probe and (step - probe) % REFIT_EVERY == 0 and step <= total / 2


def train(model, ds, rows, cfg, run, options: ModeloptOptions, device, started: float, metrics_file: Path) -> dict:
    """The budgeted run; returns its counts. ``started``: the process start (the budget's origin)."""
    from transformers import AutoTokenizer

    from dflash_train.model.target import resolve_target

    tokenizer = AutoTokenizer.from_pretrained(resolve_target(cfg.target.name))
    seq_len = padded_length(options.seq_len, cfg.drafter.block_size)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=RECIPE_DEFAULTS["lr"], weight_decay=RECIPE_DEFAULTS["weight_decay"],
                            fused=device.type == "cuda")
    schedule = BudgetSchedule(RECIPE_DEFAULTS["warmup_steps"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # recipe: tf32
    budget, warmup, probe = run.cfg.budget_min * 60, run.cfg.warmup_steps, run.cfg.probe_steps
    gen = torch.Generator().manual_seed(cfg.seed)
    order, step, tokens, window_t0 = [], 0, 0, None
    model.train()
    with metrics_file.open("w") as out:
        while time.time() - started < budget and (schedule.total is None or step < schedule.total):
            if not order:  # a new epoch, shuffled (dataloader_drop_last: every row is one batch)
                order = [rows[i] for i in torch.randperm(len(rows), generator=gen).tolist()]
            batch = modelopt_batch(ds[order.pop()], cfg.data.max_length, seq_len, pad_id, device)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=options.bf16):
                output = model(**batch)
            output.loss.backward()
            torch.nn.utils.clip_grad_norm_(params, RECIPE_DEFAULTS["max_grad_norm"])
            opt.step()
            scheduler.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            tokens += int(batch["attention_mask"].sum())
            if step == warmup:
                # the first timing window starts after the first steps' one-off costs (allocator, kernels)
                window_t0, window_start = time.time(), step
            if step == probe or refit_due(step, probe, schedule.total):
                # the speed of the latest window: from the warm-up to the probe, then the last REFIT_EVERY steps
                per_step = (time.time() - window_t0) / (step - window_start)
                window_t0, window_start = time.time(), step
                schedule.total = last_step(step, budget, time.time() - started, per_step)
                log(f"step {step}: {per_step:.3f} s per step, the schedule ends at step {schedule.total}")
            if step % 50 == 0 or step == 1:
                line = {"step": step, "time": time.time(), "loss": output.loss.item(),
                        "train_acc": float(output.train_acc[0][0]), "lr": scheduler.get_last_lr()[0]}
                out.write(json.dumps(line) + "\n")
                out.flush()
                log(f"step {step}: loss {line['loss']:.4f}, acc {line['train_acc']:.3f}, lr {line['lr']:.2e}, "
                    f"{time.time() - started:.0f} s")
    return {"steps": step, "conversations": step, "tokens": tokens, "planned_steps": schedule.total,
            "seq_len": seq_len}


def export(model, out_dir: Path) -> Path:
    """Model-Optimizer's own export (export_speculative_decoding -> DFlashExporter)."""
    from modelopt.torch.export import export_speculative_decoding

    model.eval()
    with torch.inference_mode():
        export_speculative_decoding(model, export_dir=str(out_dir))
    return out_dir


@torch.no_grad()
def export_agreement(model, export_dir: Path, input_ids: torch.Tensor) -> float:
    """The share of Model-Optimizer's own drafts of one block (pseudo_speculative_generate after
    ``input_ids``) that our loader's drafter, read from the export, drafts too: 1.0 unless the
    export or its reading lost something (near-ties in bf16 aside). Both read the same target
    features; the block is [the target's next token, mask...] after the prompt."""
    from dflash_train.model.dflash import target_features
    from dflash_train.model.io import load_drafter

    block = model.dflash_block_size
    base_token, theirs = model.pseudo_speculative_generate(input_ids, steps=block - 1)
    ours = load_drafter(export_dir, dtype=model.dtype, device=input_ids.device)
    hidden = model(input_ids=input_ids, output_hidden_states=True).hidden_states  # eval mode: the target's forward
    ids = torch.full((1, block), model.mask_token_id, dtype=torch.long, device=input_ids.device)
    ids[0, 0] = base_token[0, 0]
    context = input_ids.shape[1]
    positions = torch.arange(context + block, device=input_ids.device)[None]  # (1, C + B)
    drafted = ours(model.get_input_embeddings()(ids), target_features(hidden, ours.target_layer_ids), positions)
    mine = model.get_output_embeddings()(drafted[:, 1:]).argmax(-1)  # (1, B - 1)
    return float((mine == theirs).float().mean())


def train_and_export(run, options: ModeloptOptions, machine: list[str], device, started: float) -> dict:
    """The training stage: Model-Optimizer's drafter trained for the budget and exported."""
    import modelopt

    run_dir = Path(run.cfg.run_dir)
    cfg = our_config(our_overrides(run, machine, run_dir / "heldout"))
    ds, rows = training_rows(cfg)
    model = build_modelopt(cfg, device)
    counts = train(model, ds, rows, cfg, run, options, device, started, run_dir / "metrics.jsonl")
    train_s = time.time() - started
    export(model, run_dir / "export")
    log(f"trained {counts['steps']} steps in {train_s / 60:.1f} min; exported to {run_dir / 'export'}")
    prompts = [torch.tensor([ds[i]["input_ids"][:AGREEMENT_PROMPT]], device=device) for i in rows[:AGREEMENT_ROWS]]
    agreement = sum(export_agreement(model, run_dir / "export", p) for p in prompts) / len(prompts)
    # Reported, not enforced: a lost run costs more than a look at this line (bf16 near-ties
    # can flip a few drafts; a wrong reading of the export flips most of them).
    verdict = "" if agreement >= MIN_AGREEMENT else ": TOO FEW, the evaluation is not of its drafter"
    log(f"the export read back by our loader drafts {agreement:.0%} of Model-Optimizer's own drafts "
        f"({len(prompts)} blocks){verdict}")
    return {"trainer": f"modelopt-{modelopt.__version__}", **counts, "train_minutes": train_s / 60,
            "export_agreement": agreement}


# ------------------------------------------------------------------ our evaluation
def held_out_tau(run, machine: list[str], export_dir: Path) -> dict:
    """dflash-train's held-out expected tau and tau counted block by block of the export
    ({"val_expected_tau", "val_tau"}): the trainer's validation of the same held-out rows
    (same anchors) with every drafter weight taken from the export."""
    from dflash_train.training.trainer import Trainer

    cfg = our_config(our_overrides(run, machine, Path(run.cfg.run_dir) / "heldout", init_from=export_dir))
    trainer = Trainer(cfg)
    try:
        held_out = trainer.validate()
        return {key: held_out[key] for key in ("val_expected_tau", "val_tau")}
    finally:
        trainer.backend.shutdown()


def run_eval(command: list[str]) -> float:
    """dflash-eval's seconds, loading the target included."""
    from dflash_train.console import command_lines
    from dflash_train.run_lock import stage_env

    print(command_lines("[eval]", command[2:]), flush=True)
    start = time.perf_counter()
    if subprocess.run(command, env=stage_env()).returncode != 0:  # it writes into the run_dir we hold
        raise SystemExit(f"{PROG}: dflash-eval failed; fix the error above and run again (finished stages are reused)")
    return time.perf_counter() - start


def summary(trained: dict, tau: float, evals: dict, eval_s: float, val_tau: float | None = None) -> dict:
    """dflash-quality's table numbers (quality.summarise's keys) for this trainer."""
    return {"train_minutes": trained["train_minutes"], "eval_minutes": eval_s / 60, "steps": trained["steps"],
            "conversations": trained["conversations"], "val_expected_tau": tau, "val_tau": val_tau,
            "tau": {n: d["tau"] for n, d in evals.items()}, "prompts": {n: d["num_prompts"] for n, d in evals.items()}}


def _stage(path: Path, make):
    """A finished stage's JSON, or ``make()``'s, kept at ``path``."""
    if not path.exists():
        path.write_text(json.dumps(make(), indent=2))
    return json.loads(path.read_text())


def _run(argv: list[str] | None) -> None:
    started = time.time()
    from dflash_train.run_lock import hold_folder

    run, options = load(sys.argv[1:] if argv is None else argv)
    with hold_folder(run.cfg.run_dir, "run_dir", PROG):
        _compare(run, options, started)


def _compare(run, options: ModeloptOptions, started: float) -> None:
    from dflash_train import quality

    run_dir = Path(run.cfg.run_dir)
    check_run_dir(run_dir, settings(run, options))
    cuda = torch.cuda.is_available()
    machine = quality.machine_defaults(cuda, importlib.util.find_spec("wandb") is not None)
    device = torch.device(run.cfg.device or ("cuda" if cuda else "cpu"))  # dflash-quality's default
    export_dir = run_dir / "export"
    if not (export_dir / "model.safetensors").exists():
        (run_dir / TRAIN_FILE).unlink(missing_ok=True)
    trained = _stage(run_dir / TRAIN_FILE, lambda: train_and_export(run, options, machine, device, started))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    tau = _stage(run_dir / HELD_OUT_FILE, lambda: held_out_tau(run, machine, export_dir))
    eval_dir = run_dir / "eval"
    if not (eval_dir / "results.json").exists():
        eval_s = run_eval(quality.eval_command(run, export_dir, eval_dir, str(device)))  # dflash-quality's eval stage
        (run_dir / EVAL_TIME_FILE).write_text(json.dumps({"seconds": eval_s}))
    evals = json.loads((eval_dir / "results.json").read_text())["datasets"]
    eval_time = run_dir / EVAL_TIME_FILE
    eval_s = json.loads(eval_time.read_text())["seconds"] if eval_time.exists() else float("nan")
    s = summary(trained, tau["val_expected_tau"], evals, eval_s, tau.get("val_tau"))  # none in an older stage file
    (run_dir / "quality.json").write_text(json.dumps({**trained, **s}, indent=2))
    print(f"\nModel-Optimizer DFlash: target={run.target_recipe} data={run.data_path} budget={run.cfg.budget_min:g} min")
    print(quality.table(s))


def main(argv: list[str] | None = None) -> None:
    from dflash_train.errors import run_command

    run_command(PROG, _run, argv)


if __name__ == "__main__":
    main()
