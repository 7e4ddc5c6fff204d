#!/usr/bin/env python3
"""Model-Optimizer's DFlash drafter on our data for a wall-clock budget, scored by our evaluation.

    PYTHONPATH=/tmp/site:/tmp/site_mo python3 benchmarks/modelopt_quality.py \\
        --data /tmp/data/sharegpt-qwen25-coder-05b --budget-min 20 --run-dir /tmp/mo20 \\
        --set target.name=/tmp/qwen25coder05b.gguf --eval --eval-set batch_size=120

The other side of dflash-quality (issue 27): the same target, rows, loss masks and held-out
split, the same minutes on one GPU, the same evaluation; what differs is the trainer.
  1. Our recipe (recipes/train.yaml with --target, +experiment=--experiment and --set
     overrides, as dflash-quality composes it) fixes the target, the drafter geometry (layers,
     block, target layer ids, mask token), the anchors, the seed and the held-out rows.
  2. Model-Optimizer 0.47 trains its own drafter as its DFlash recipe
     (modelopt_recipes/general/speculative_decoding/dflash.yaml and examples/speculative_decoding/
     main.py) does, with our geometry: mtsp.convert(target, [("dflash", cfg)]) on the target loaded
     as main.py loads it (dtype="auto"), self-logit distillation, D-PACE position weights (the
     library's default objective, alpha 0.5), one conversation per step right-padded to
     training_seq_len (--seq-len, 4096) with labels on the assistant tokens only
     (answer_only_loss); the HF Trainer's step: bf16 autocast, AdamW lr 6e-4 with weight decay 0
     (fused on CUDA), gradient clipping at 1.0, a linear schedule after 100 warm-up steps. The
     schedule ends where the budget does, as max_steps makes HF's do: the seconds per step of
     the first --probe-steps steps (inside the warm-up, so nothing is wasted) fix the last step.
  3. The budget runs from the start of this process (loading included), like dflash-quality's
     train stage; Model-Optimizer's own export_speculative_decoding then writes the drafter.
  4. Our evaluation reads that export through model/foreign.py: dflash-train's held-out expected
     tau on the held-out rows (Trainer.validate, drafter.init_from=<export>) and, with --eval,
     dflash-eval on MT-Bench and HumanEval (first --limit prompts, --max-new-tokens tokens).
Prints dflash-quality's table; writes <run-dir>/quality.json and <run-dir>/metrics.jsonl.

Needs nvidia-modelopt 0.47.0 and the wheels of ../shared/anchors/modelopt/wheels.txt except
omegaconf 2.4 (Hydra needs 2.3; the DFlash path runs on 2.3), installed into their own --target
folder that comes after ours on PYTHONPATH; Model-Optimizer also imports scipy.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch

RECIPE_DEFAULTS = {  # modelopt_recipes/general/speculative_decoding/dflash.yaml, 0.47.0
    "lr": 6e-4, "warmup_steps": 100, "weight_decay": 0.0, "max_grad_norm": 1.0, "seq_len": 4096,
}
IGNORE_TOKEN_ID = -100  # HF's label for "no loss here"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="a dflash-datagen output folder (the one dflash-quality trains on)")
    p.add_argument("--budget-min", type=float, required=True, help="wall-clock minutes, loading included")
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--target", default="qwen25_coder_05b", help="target recipe (recipes/target/<name>.yaml)")
    p.add_argument("--experiment", default="qwen25_coder_05b_1xh100", help="+experiment recipe ('' for none)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="our recipe's overrides")
    p.add_argument("--val-rows", type=int, default=64, help="held-out conversations (dflash-quality's default)")
    p.add_argument("--seq-len", type=int, default=RECIPE_DEFAULTS["seq_len"], help="training_seq_len: rows are padded to it")
    p.add_argument("--probe-steps", type=int, default=20, help="steps timed to plan the schedule (< 100 warm-up steps)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--eval", action="store_true", help="also run dflash-eval on the export")
    p.add_argument("--limit", type=int, default=40)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--eval-set", action="append", default=[], metavar="KEY=VALUE", help="dflash-eval overrides")
    return p.parse_args(argv)


def log(msg: str) -> None:
    print(f"[modelopt-quality] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ our recipe and data
def our_config(args, output_dir: Path, init_from: Path | None = None):
    """dflash-train's validated config, composed as dflash-quality composes its train stage."""
    from dflash_train.config import TrainConfig, to_train_config
    from dflash_train.recipe import compose_recipe

    overrides = [f"target={args.target}", f"data.path={args.data}", *([f"+experiment={args.experiment}"]
                 if args.experiment else []), *args.set, f"output_dir={output_dir}", f"data.val_rows={args.val_rows}",
                 "logging.wandb=disabled", "logging.progress_bar=false", "export=false", "checkpoint.every=0",
                 "checkpoint.resume=false"]
    if init_from is not None:  # evaluation: the recipe's own validation, every weight from the export
        overrides += [f"drafter.init_from={init_from}", "drafter.init_from_target=false"]
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
    if not cfg.data.val_rows:
        return ds, list(range(len(ds)))
    train, _ = split_validation(len(ds), cfg.data.val_rows, cfg.seed)
    return ds, train


def modelopt_batch(row: dict, max_length: int, seq_len: int, pad_id: int, device) -> dict:
    """One conversation as Model-Optimizer's LanguageDataCollator hands it over: right-padded to
    training_seq_len, labels = the ids on assistant tokens (our loss mask) and -100 elsewhere."""
    ids = list(row["input_ids"][:max_length])
    mask = list(row["loss_mask"][:max_length])
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
        raise SystemExit(f"Model-Optimizer needs one target layer per draft layer; the recipe has {len(ids)} "
                         f"features for {d.num_hidden_layers} layers")
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

    from dflash_train.model.target import resolve_target

    model = AutoModelForCausalLM.from_pretrained(resolve_target(cfg.target.name), dtype="auto")
    settings = dflash_settings(cfg, model.config)
    model = mtsp.convert(model, [("dflash", settings)]).to(device)
    dc = model.dflash_config
    log(f"modelopt {modelopt.__version__}: target {model.dtype}, draft layers {dc.num_hidden_layers}, inter "
        f"{dc.intermediate_size}, heads {dc.num_attention_heads}/{dc.num_key_value_heads}, head_dim {dc.head_dim}, "
        f"target_layer_ids {model.target_layer_ids}, block {model.dflash_block_size}, mask {model.mask_token_id}, "
        f"objective {model.dflash_loss_objective}, distillation {model.dflash_self_logit_distillation}")
    arch = settings["dflash_architecture_config"]
    assert list(model.target_layer_ids) == arch["target_layer_ids"] and dc.intermediate_size == arch["intermediate_size"]
    return model


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


def train(model, ds, rows, cfg, args, started: float, metrics_file: Path) -> dict:
    """The budgeted run; returns its counts. ``started``: the process start (the budget's origin)."""
    from transformers import AutoTokenizer

    from dflash_train.model.target import resolve_target

    device = torch.device(args.device)
    tokenizer = AutoTokenizer.from_pretrained(resolve_target(cfg.target.name))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    seq_len = math.ceil(args.seq_len / cfg.drafter.block_size) * cfg.drafter.block_size  # modelopt needs a multiple
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=RECIPE_DEFAULTS["lr"], weight_decay=RECIPE_DEFAULTS["weight_decay"],
                            fused=device.type == "cuda")
    schedule = BudgetSchedule(RECIPE_DEFAULTS["warmup_steps"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # recipe: tf32
    budget = args.budget_min * 60
    gen = torch.Generator().manual_seed(cfg.seed)
    order, step, tokens, t_probe = [], 0, 0, None
    model.train()
    with metrics_file.open("w") as out:
        while time.time() - started < budget and (schedule.total is None or step < schedule.total):
            if not order:  # a new epoch, shuffled (dataloader_drop_last: every row is one batch)
                order = [rows[i] for i in torch.randperm(len(rows), generator=gen).tolist()]
            row = ds[order.pop()]
            batch = modelopt_batch(row, cfg.data.max_length, seq_len, pad_id, device)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16):  # training.bf16
                output = model(**batch)
            output.loss.backward()
            torch.nn.utils.clip_grad_norm_(params, RECIPE_DEFAULTS["max_grad_norm"])
            opt.step()
            scheduler.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            tokens += int(batch["attention_mask"].sum())
            if step == 3:
                t_probe = time.time()  # after the first steps' one-off costs (allocator, kernels)
            if step == args.probe_steps and t_probe is not None:
                per_step = (time.time() - t_probe) / (step - 3)
                schedule.total = step + max(1, int((budget - (time.time() - started)) / per_step))
                log(f"{per_step:.3f} s per step: the schedule ends at step {schedule.total}")
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


# ------------------------------------------------------------------ our evaluation
def held_out_tau(args, export_dir: Path) -> float:
    """dflash-train's held-out expected tau of the export: the trainer's validation of the same
    held-out rows (same anchors) with every drafter weight taken from the export."""
    from dflash_train.training.trainer import Trainer

    cfg = our_config(args, args.run_dir / "heldout", init_from=export_dir)
    trainer = Trainer(cfg)
    try:
        return trainer.validate()["val_expected_tau"]
    finally:
        trainer.backend.shutdown()


def run_eval(args, export_dir: Path) -> tuple[dict, float]:
    """dflash-eval of the export as dflash-quality runs it; ({dataset: results}, seconds)."""
    from dflash_train.quality import DATASETS

    out = args.run_dir / "eval"
    cmd = [sys.executable, "-m", "dflash_train.eval.cli", f"target={args.target}", *args.set,
           f"drafter_path={export_dir}", f"output_dir={out}", f"datasets=[{','.join(DATASETS)}]", f"limit={args.limit}",
           f"max_new_tokens={args.max_new_tokens}", f"device={args.device}", *args.eval_set]
    start = time.perf_counter()
    if subprocess.run(cmd).returncode != 0:
        raise SystemExit("dflash-eval failed; see above")
    return json.loads((out / "results.json").read_text())["datasets"], time.perf_counter() - start


def main(argv=None) -> None:
    started = time.time()
    args = parse_args(argv)
    if args.val_rows < 1 or args.probe_steps < 4 or args.budget_min <= 0:
        raise SystemExit(f"need --val-rows >= 1, --probe-steps >= 4 and a positive --budget-min; got "
                         f"{args.val_rows}, {args.probe_steps}, {args.budget_min}")
    args.run_dir.mkdir(parents=True, exist_ok=True)
    cfg = our_config(args, args.run_dir / "heldout")
    ds, rows = training_rows(cfg)
    model = build_modelopt(cfg, torch.device(args.device))
    counts = train(model, ds, rows, cfg, args, started, args.run_dir / "metrics.jsonl")
    train_s = time.time() - started
    export_dir = export(model, args.run_dir / "export")
    log(f"trained {counts['steps']} steps in {train_s / 60:.1f} min; exported to {export_dir}")
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    tau = held_out_tau(args, export_dir)
    evals, eval_s = run_eval(args, export_dir) if args.eval else ({}, float("nan"))
    from dflash_train.quality import table

    summary = {"train_minutes": train_s / 60, "eval_minutes": eval_s / 60, "steps": counts["steps"],
               "conversations": counts["conversations"], "val_expected_tau": tau,
               "tau": {n: d["tau"] for n, d in evals.items()}, "prompts": {n: d["num_prompts"] for n, d in evals.items()}}
    (args.run_dir / "quality.json").write_text(json.dumps({"trainer": "modelopt-0.47.0", **counts, **summary}, indent=2))
    print(f"\nModel-Optimizer DFlash: target={cfg.target.name} data={args.data} budget={args.budget_min:g} min")
    print(table(summary))


if __name__ == "__main__":
    main()
