"""The training loop: frozen target features online, drafter forward/backward, DFlash loss.

One optimizer step = ``grad_accum_steps`` micro-batches of ``micro_batch_size`` rows on each
of ``world_size`` processes (the global batch). Everything distributed goes through the
backend; this file never asks which one it has.

Loss normalisation, identical for any world size: the loss of a step is
    sum over all micro-batches of all ranks of sum_k w_k * CE_k  /  sum of w_k over valid slots,
with the denominator all-reduced before the first backward. The backend divides each
micro-batch loss by grad_accum_steps and averages gradients over ranks, so each micro-batch
passes its weighted sum times grad_accum_steps * world_size / denominator.
"""

from __future__ import annotations

import json
import logging
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from dflash_train import contract
from dflash_train.atomic import atomic_write_text
from dflash_train.config import TrainConfig, as_dict
from dflash_train.data.collate import Batch, collate
from dflash_train.data.dataset import StepSlice, TrainingData
from dflash_train.data.format import check_rows, check_target, load_generated, read_manifest
from dflash_train.data.packing import document_causal_mask
from dflash_train.distributed.backend import Backend
from dflash_train.distributed.build import build_backend
from dflash_train.errors import RunError, check_writable_dir
from dflash_train.eval.report import results_table
from dflash_train.model.card import model_card_files
from dflash_train.model.init import drafter_config, init_from_checkpoint, init_from_target, init_summary
from dflash_train.model.io import check_export_destination, save_drafter
from dflash_train.model.kinds import new_drafter
from dflash_train.model.masks import build_training_masks
from dflash_train.model.target import (
    TargetModel,
    load_target,
    load_tokenizer,
    target_dtype,
    target_identity,
    tokenizer_hash,
    tokenizer_identity,
    weights_digest,
)
from dflash_train.training import flops
from dflash_train.training.checkpoint import (
    CheckpointWriter,
    TrainerState,
    checkpoint_config,
    checkpoint_problem,
    drafter_shape_change,
    latest_checkpoint,
    latest_good_checkpoint,
    load_checkpoint,
    resume_changes,
    save_checkpoint,
    step_dir_name,
)
from dflash_train.training.dspark_loss import DSparkLossWeights, dspark_loss
from dflash_train.training.feature_cache import FeatureCache, bytes_needed
from dflash_train.training.logging import MetricsLogger, MetricWindow, position_accuracy
from dflash_train.training.loss import Distillation, LossOutput, dflash_loss, selector_term, supervised_blocks
from dflash_train.training.optim import optimizer_factory, scheduler_factory
from dflash_train.training.run_dir import (
    EXPORT_DIR,
    INIT_MAP_FILE,
    MANIFEST_COPY,
    check_sinks,
    check_train_output_dir,
    mark_output_dir,
)

log = logging.getLogger(__name__)
# A save that waits longer than this for the previous checkpoint's write says so.
SLOW_WRITE_S = 1.0


def split_validation(num_rows: int, val_rows: int, seed: int) -> tuple[list[int], list[int]]:
    """(training row ids, held-out row ids): ``val_rows`` conversations picked by a seeded
    permutation, so a resumed or re-run job holds out the same ones."""
    if val_rows >= num_rows:
        raise ValueError(f"data.val_rows={val_rows} leaves no training rows (the dataset has {num_rows})")
    gen = torch.Generator().manual_seed(contract.derive_seed("validation", seed, 0))
    perm = torch.randperm(num_rows, generator=gen).tolist()
    return sorted(perm[val_rows:]), sorted(perm[:val_rows])


def _target_weights(spec: str) -> str | None:
    """The target's weights digest, recorded in checkpoints and exports (None: cannot tell)."""
    try:
        return weights_digest(spec)
    except (ValueError, OSError):
        return None


class NonFiniteLossError(RunError):
    """Too many steps with a NaN/inf loss: the run is diverging or the data is broken."""


class Trainer:
    """Builds data, target, drafter and optimizer from a validated TrainConfig; ``fit`` trains.

    ``backend``, ``target`` and ``data`` may be passed in prebuilt (the benchmark builds a
    random target straight on the backend's device and uses random data); normally all
    three come from the recipe.
    """

    def __init__(self, cfg: TrainConfig, *, backend: Backend | None = None, target: TargetModel | None = None,
                 data: TrainingData | None = None):
        self.cfg = cfg
        self.output_dir = Path(cfg.output_dir)
        self.backend = backend or build_backend(cfg.backend)
        if self.backend.is_main:
            check_sinks(cfg.logging)
            # Before minutes of loading and hours of training: where the results go.
            check_train_output_dir(self.output_dir)
            check_writable_dir(self.output_dir, "output_dir")
            if cfg.export:
                check_export_destination(self.output_dir / EXPORT_DIR, "dflash-train")
        self._setup_data(data)  # before any model: bad data fails in seconds, not minutes
        self._setup_model(target)
        if self.manifest is not None:  # rows read from disk: every id must index this target's embedding
            check_rows(self.data.ds, self.target.vocab_rows, cfg.data.path)
        self._setup_optimizer()
        self.target_weights = _target_weights(cfg.target.name)
        self.state = TrainerState(global_batch=self.slice.global_batch, target_weights=self.target_weights)
        self._orders: dict[int, torch.Tensor] = {}  # epoch -> row order
        self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-batches")
        self._prefetched: dict[int, Future] = {}
        self.checkpoints = CheckpointWriter() if cfg.checkpoint.async_write else None

    # ----------------------------------------------------------------------------- setup
    def _setup_data(self, data: TrainingData | None) -> None:
        cfg, b = self.cfg, self.backend
        self.manifest = None
        self.val_data: TrainingData | None = None
        if data is None:
            self.manifest = read_manifest(cfg.data.path)
            if cfg.data.check_manifest:
                tokenizer = load_tokenizer(cfg.target.name)
                check_target(self.manifest, target_identity(cfg.target.name), tokenizer_identity(tokenizer),
                             tokenizer_hash(tokenizer))
            ds = load_generated(cfg.data.path)
            kwargs = dict(max_length=cfg.data.max_length, packing=cfg.data.packing, seed=cfg.seed,
                          num_anchors=cfg.data.num_anchors, block_size=cfg.drafter.block_size,
                          mask_token_id=cfg.target.mask_token_id, blocks_per_row=cfg.data.blocks_per_row,
                          kind=cfg.drafter.kind)
            train_rows = None
            if cfg.data.val_rows:
                train_rows, val_rows = split_validation(len(ds), cfg.data.val_rows, cfg.seed)
                self.val_data = TrainingData(ds, shuffle=False, indices=val_rows, **kwargs)
            data = TrainingData(ds, shuffle=cfg.data.shuffle, indices=train_rows, **kwargs)
        self.data = data
        self.slice = StepSlice(cfg.optim.micro_batch_size, cfg.optim.grad_accum_steps, b.world_size, b.rank)
        self.steps_per_epoch = len(data) // self.slice.global_batch
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"{len(data)} training rows cannot fill one global batch of {self.slice.global_batch} "
                f"(micro_batch_size * grad_accum_steps * world_size)"
            )
        self.total_steps = self.steps_per_epoch * cfg.epochs
        self.last_step = min(self.total_steps, cfg.max_steps or self.total_steps)
        if b.is_main and data.num_truncated:
            log.warning("%d of %d sequences truncated to max_length=%d",
                        data.num_truncated, len(data.indices), data.max_length)

    def _setup_model(self, target: TargetModel | None) -> None:
        cfg = self.cfg
        if target is None:
            # Loaded on the CPU and moved by the backend: ``auto`` means the dtype for where it runs.
            target = load_target(cfg.target.name, dtype=target_dtype(cfg.target.dtype, self.backend.device), device="cpu")
        if target.num_layers != cfg.target.num_layers:
            raise ValueError(f"target.num_layers={cfg.target.num_layers} but {cfg.target.name} has {target.num_layers}")
        if not 0 <= cfg.target.mask_token_id < target.vocab_rows:
            raise ValueError(f"target.mask_token_id={cfg.target.mask_token_id} is outside the embedding "
                             f"(0..{target.vocab_rows - 1})")
        self.target = target
        d = cfg.drafter
        self.drafter_config = drafter_config(cfg, target.config)
        torch.manual_seed(cfg.seed)  # the drafter's initial weights depend on the seed only
        self.drafter = new_drafter(self.drafter_config)
        # {drafter weight: target weight}, written to the run folder by fit (INIT_MAP_FILE)
        self.copied_from_target = init_from_target(self.drafter, target.model) if d.init_from_target else {}
        if d.init_from:  # every weight, so after init_from_target (which it then replaces)
            init_from_checkpoint(self.drafter, d.init_from, target, _target_weights(cfg.target.name),
                                 d.init_from_other_target)
            if self.backend.is_main:
                log.info("drafter initialised from %s", d.init_from)
        # After the copy: a sharded target's weights are no longer plain tensors.
        target.model = self.backend.prepare_target(target.model)
        if cfg.target.compile:
            target.compile_layers(cfg.target.compile_rounding)
        self.drafter.activation_checkpointing = d.activation_checkpointing
        if d.flex_backend == "flash":
            for layer in self.drafter.layers:
                layer.self_attn.flex_kernel_options = {"BACKEND": "FLASH"}
        if d.compile:
            for layer in self.drafter.layers:
                layer.compile()  # per layer: the flex-attention kernels need compiling too
        self.layer_ids = self.drafter.target_layer_ids
        gamma = cfg.loss.gamma or contract.default_gamma(d.block_size)
        # On the device: a host tensor would be copied (and waited for) at every use.
        self.slot_weights = contract.slot_weights(d.block_size, gamma, d.kind).to(self.backend.device)
        self.dpace_alpha = cfg.loss.dpace_alpha if cfg.loss.position_weighting == "dpace" else None
        self.distill = cfg.loss.distill_weight > 0
        self.dspark = d.kind == contract.DSPARK
        # The target's final hidden states: distillation's soft targets, DSpark's L1 teacher.
        self.needs_final = self.distill or self.dspark
        # Per-position statistics: entry 0 the anchor, entry k the k-th token drafted after it.
        self.positions = self.drafter.drafts_per_block + 1
        # Compute dtype of the drafter's inputs: bf16 under the backend's mixed precision.
        self.input_dtype = self.backend.mixed_dtype or torch.float32
        self.feature_cache = FeatureCache() if cfg.data.cache_features else None
        if self.feature_cache is not None and self.backend.is_main:
            width = self.drafter.fc.in_features + (self.target.hidden_size if self.dspark else 0)
            size = bytes_needed(self.data.num_tokens, width, self.input_dtype)
            log.info("data.cache_features: the target's features of %d training rows take %.2f GB on %s "
                     "once all are kept (the target runs on each row once)", len(self.data), size / 1e9,
                     self.backend.device)

    def _setup_optimizer(self) -> None:
        o = self.cfg.optim
        self.backend.setup(
            self.drafter, optimizer_factory(o), scheduler_factory(o, o.schedule_steps or self.total_steps),
            clip_grad_norm=o.grad_clip, grad_accum_steps=o.grad_accum_steps,
        )

    # ------------------------------------------------------------------------ one step
    def host_batches(self, step: int) -> list[Batch]:
        """This process's micro-batches of global step ``step``, built on the host."""
        epoch, in_epoch = divmod(step, self.steps_per_epoch)
        order = self._orders.get(epoch)
        if order is None:
            order = self._orders[epoch] = self.data.epoch_order(epoch)
        batches = []
        for m in range(self.slice.grad_accum_steps):
            rows = self.slice.rows(order, in_epoch, m)
            batch = self._collate([self.data.example(r, epoch) for r in rows], self.data, rows)
            batches.append(batch.pin_memory() if self.backend.device.type == "cuda" else batch)
        return batches

    def _collate(self, examples: list[dict], data: TrainingData, data_rows: list[int] | None = None) -> Batch:
        # Fixed shapes also fix the number of rows: a compiled drafter then sees one shape.
        rows = self.slice.micro_batch_size if data.fixed_shape else None
        return collate(examples, self.cfg.target.mask_token_id, shape=data.fixed_shape, rows=rows,
                       data_rows=data_rows)

    def micro_batches(self, step: int) -> list[Batch]:
        """This process's micro-batches of global step ``step``, on the device: the ones
        ``prefetch(step)`` built on the host thread, or built now."""
        pending = self._prefetched.pop(step, None)
        batches = pending.result() if pending is not None else self.host_batches(step)
        for stale in self._prefetched.values():
            stale.cancel()
        self._prefetched = {}
        return [b.to(self.backend.device) for b in batches]

    def prefetch(self, step: int) -> None:
        """Start building step ``step``'s host batches on a thread (tokens to tensors,
        anchors, labels, pinning). ``train_step`` calls it once the current step's GPU work
        is queued and it is about to wait for the GPU: the thread then has the interpreter
        to itself, instead of taking it from the thread that launches the kernels."""
        if step not in self._prefetched:
            self._prefetched[step] = self._prefetcher.submit(self.host_batches, step)

    @staticmethod
    def target_mask(batch: Batch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The attention mask and positions the frozen target runs ``batch`` with."""
        # Packed rows keep their conversations apart with a block-diagonal causal mask. Rows
        # without padding need none: the host knows, where HF would check the mask on the
        # device and wait for it (a sync that leaves the GPU idle while the step relaunches).
        # Their positions are then 0..T-1, HF's own default: passing them would make it look
        # for packed sequences in them, on the device, and wait for the answer too.
        if batch.doc_ids is not None:
            return document_causal_mask(batch.doc_ids), batch.position_ids
        if batch.stats.tokens == batch.input_ids.numel():
            return None, None
        return batch.attention_mask, batch.position_ids

    def target_inputs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Frozen-target features (b, T, n*H), block-token embeddings (b, Q, H) and, when
        distilling, the target's final hidden states (b, T, H) in the head's dtype (else None).
        Training rows' features come from the feature cache once it holds them (data.cache_features)."""
        cached = self.feature_cache.get(batch) if self.feature_cache is not None else None
        if cached is not None:
            with torch.inference_mode():
                noise = self.target.embed_tokens(batch.block_ids)
            final = None
            if self.dspark:  # kept beside the features (``put`` below)
                cached, final = cached.split([self.drafter.fc.in_features, self.target.hidden_size], dim=-1)
            return cached, noise.to(self.input_dtype, copy=True), final
        mask, positions = self.target_mask(batch)
        final = None
        with torch.inference_mode():
            args = (batch.input_ids, self.layer_ids)
            kwargs = dict(attention_mask=mask, position_ids=positions)
            if self.needs_final:
                # final stays an inference tensor: the loss only gathers rows of it, outside autograd.
                feats, final = self.target.features_and_final(*args, **kwargs)
            else:
                feats = self.target.features(*args, **kwargs)
            noise = self.target.embed_tokens(batch.block_ids)
        # copy=True turns inference tensors into ordinary ones that autograd may save.
        feats = feats.to(self.input_dtype, copy=True)
        if self.feature_cache is not None:
            # DSpark's L1 teacher, the final hidden states, is kept too (in the features' dtype).
            self.feature_cache.put(batch, torch.cat([feats, final.to(feats.dtype)], dim=-1) if self.dspark else feats)
        return feats, noise.to(self.input_dtype, copy=True), final

    def masks(self, batch: Batch) -> dict:
        return build_training_masks(self.drafter_config, batch.anchors, batch.anchor_valid,
                                    batch.input_ids.shape[1], batch.doc_ids, kind=self.cfg.drafter.attention)

    def draft(self, batch: Batch, feats: torch.Tensor, noise: torch.Tensor, masks: dict) -> torch.Tensor:
        position_ids = torch.cat([batch.position_ids, batch.block_position_ids], dim=1)  # (b, T + Q)
        return self.backend.model(noise, feats, position_ids, attention_mask=masks)  # (b, Q, H)

    def loss(self, batch: Batch, hidden: torch.Tensor, final: torch.Tensor | None = None) -> LossOutput:
        """The step's loss (DSpark's for drafter.kind=dspark); ``final`` (b, T, H): the target's
        final hidden states when distilling or training DSpark."""
        lc = self.cfg.loss
        if self.dspark:
            alphas = DSparkLossWeights(lc.dspark_ce_alpha, lc.dspark_l1_alpha, lc.dspark_confidence_alpha)
            return dspark_loss(self.drafter, hidden, batch.labels, batch.block_ids, batch.anchors, final,
                               self.target.lm_head, self.slot_weights, lc.chunk_size, alphas,
                               index=batch.supervised_index)
        distill = None if final is None else Distillation(final, batch.anchors, lc.distill_weight,
                                                          lc.distill_temperature)
        dflash2 = self.cfg.drafter.kind == contract.DFLASH2
        # DFlash2's selector rescores each slot's unary top-K, taken from the loss's own logits.
        top_k = self.drafter.selector_top_k if dflash2 else 0
        out = dflash_loss(hidden, batch.labels, self.target.lm_head, self.slot_weights, lc.chunk_size,
                          index=batch.supervised_index, distill=distill, dpace_alpha=self.dpace_alpha, top_k=top_k)
        if dflash2:  # its candidate selector's K-way CE (model/dflash2.py); its walk's accepted drafts
            settings = self.cfg.drafter.dflash2
            selector, walk_correct, out.accepted = selector_term(
                self.drafter, hidden, batch.labels, batch.input_ids, batch.anchors, self.target.lm_head,
                out.candidates, batch.supervised_index, stop_gradient=settings.selector_stop_gradient)
            out.weighted_sum = out.weighted_sum + settings.selector_loss_weight * selector
            # Its drafts are the walk's picks, not the unary argmax: accuracies and tau count those.
            out.unary_correct, out.correct = out.correct, walk_correct
        return out

    def loss_normaliser(self, labels: torch.Tensor) -> torch.Tensor:
        """This micro-batch's share of the loss denominator (see ``LossOutput.weight_sum``)."""
        if self.dpace_alpha is not None:
            return supervised_blocks(labels, self.drafter.block_size)
        return contract.loss_weight_sum(labels, self.slot_weights)

    def micro_step(self, batch: Batch) -> LossOutput:
        feats, noise, final = self.target_inputs(batch)
        return self.loss(batch, self.draft(batch, feats, noise, self.masks(batch)), final)

    def train_step(self, step: int) -> dict:
        """One optimizer step; returns globally reduced sums for the metric window."""
        batches = self.micro_batches(step)
        weight_sum = sum(self.loss_normaliser(b.labels) for b in batches)
        global_weight = self.backend.all_reduce_sum(weight_sum).clamp(min=1e-12)
        scale = self.slice.grad_accum_steps * self.slice.world_size / global_weight
        loss_sum = torch.zeros((), device=self.backend.device)
        correct = count = blocks = accepted = 0
        conversations = tokens = step_flops = 0.0
        for m, batch in enumerate(batches):
            out = self.micro_step(batch)
            self.backend.backward(out.weighted_sum * scale, sync=m == len(batches) - 1)
            loss_sum = loss_sum + out.weighted_sum.detach()
            correct, count = correct + out.correct, count + out.count
            blocks, accepted = blocks + out.blocks, accepted + out.accepted
            conversations += batch.stats.conversations
            tokens += batch.stats.tokens
            step_flops += self._flops(batch)
        self.prefetch(step + 1)
        # Pinned: a copy from pageable memory would wait for the queued backward first.
        local = torch.tensor([tokens, step_flops, conversations], dtype=torch.float64)
        if self.backend.device.type == "cuda":
            local = local.pin_memory()
        local = local.to(self.backend.device, non_blocking=True)
        sums = torch.cat([loss_sum.reshape(1).double(), local, torch.stack([blocks, accepted]).double(),
                          correct.double(), count.double()])
        sums = self.backend.all_reduce_sum(sums)
        # A non-finite loss, or a finite one with inf/NaN gradients, skips the update:
        # weights, moments and schedule stay as they were, and the norm comes back NaN.
        grad_norm = self.backend.step(loss=sums[0])
        finite = math.isfinite(grad_norm)
        b = self.positions
        return {"finite": finite, "loss_sum": sums[0], "weight_sum": global_weight.double(), "tokens": sums[1],
                "flops": sums[2], "conversations": sums[3], "blocks": sums[4], "accepted": sums[5],
                "correct": sums[6:6 + b], "count": sums[6 + b:], "grad_norm": grad_norm}

    def _flops(self, batch: Batch) -> float:
        """Useful FLOPs of a micro-batch: real tokens, valid blocks and supervised slots only
        (padding is computed but not counted, so MFU shows what packing wastes)."""
        s = batch.stats
        if not s.tokens:
            return 0.0
        shape = flops.StepShape(context_tokens=s.tokens, query_tokens=s.blocks * self.drafter.block_size,
                                supervised_slots=s.supervised, mean_anchor=s.context_sum / max(s.blocks, 1))
        cfg = self.target.config
        # attention_pairs / tokens: the mean causal span that makes the target's attention exact.
        layers_run = self.target.num_layers if self.needs_final else max(self.layer_ids) + 1
        target = flops.target_forward_flops(cfg, layers_run, s.tokens, s.attention_pairs / s.tokens)
        return (target + flops.drafter_train_flops(self.drafter, shape)
                + flops.loss_flops(cfg.hidden_size, self.target.vocab_rows, s.supervised, distill=self.needs_final))

    @torch.no_grad()
    def validate(self) -> dict:
        """Loss, per-position accuracy, expected tau and tau counted block by block
        (``val_tau``) on the held-out rows, with the same anchors every time (epoch 0's). The
        training metrics are measured on rows the drafter is fitting; these tell whether it
        generalises. A DFlash2 drafter's accuracies and tau are its selector walk's (what it
        drafts); ``val_unary_expected_tau`` is its unary argmax's."""
        val = self.val_data
        b = self.positions
        world, rank, per = self.slice.world_size, self.slice.rank, self.slice.micro_batch_size
        unary = self.cfg.drafter.kind == contract.DFLASH2
        sums = torch.zeros(4 + (3 if unary else 2) * b, dtype=torch.float64, device=self.backend.device)
        self.drafter.eval()
        try:
            # Every rank runs the same number of forwards (sharded models gather weights
            # collectively) in micro-batches shaped like training's (a compiled drafter reuses
            # its graphs); a rank past the end repeats row 0 and counts nothing.
            for i in range(-(-len(val) // (world * per))):
                first = (i * world + rank) * per
                rows = list(range(first, min(first + per, len(val))))
                batch = self._collate([val.example(r, 0) for r in rows or [0]], val).to(self.backend.device)
                out = self.micro_step(batch)
                if rows:
                    sums += torch.cat([out.weighted_sum.reshape(1), out.weight_sum.reshape(1), out.blocks.reshape(1),
                                       out.accepted.reshape(1), out.correct, out.count,
                                       *([out.unary_correct] if unary else [])]).double()
        finally:
            self.drafter.train()
        sums = self.backend.all_reduce_sum(sums)
        count = sums[4 + b:4 + 2 * b].tolist()
        acc = position_accuracy(sums[4:4 + b].tolist(), count)
        result = {"val_loss": float(sums[0] / sums[1].clamp(min=1e-12)),
                  "val_expected_tau": contract.expected_acceptance_length(torch.tensor(acc)),
                  "val_tau": contract.acceptance_length(float(sums[2]), float(sums[3])),
                  **{f"val_acc_pos_{k}": a for k, a in enumerate(acc, start=1)}}
        if unary:
            unary_acc = position_accuracy(sums[4 + 2 * b:].tolist(), count)
            result["val_unary_expected_tau"] = contract.expected_acceptance_length(torch.tensor(unary_acc))
        return result

    def _validation_due(self, step: int) -> bool:
        every = self.cfg.data.val_every
        return self.val_data is not None and (step == self.last_step or bool(every and step % every == 0))

    # ---------------------------------------------------------------------------- fit
    def resume(self) -> None:
        """Continue from the newest intact checkpoint, if its recipe computes what this one does."""
        mode = self.cfg.checkpoint.resume
        if not mode:
            path = latest_checkpoint(self.output_dir)
            if path is not None:
                raise ValueError(f"{self.output_dir} already holds checkpoints (latest {path.name}) but "
                                 "checkpoint.resume=false; pick a new output_dir or allow resuming")
            return
        path = latest_good_checkpoint(self.output_dir)
        if path is None:
            return
        changes = resume_changes(path, as_dict(self.cfg), self.target_weights)
        if changes and mode != "force":
            raise ValueError(f"{self.output_dir} holds a run with other settings ({'; '.join(changes)}): "
                             "resume with the checkpoint's settings, pick a new output_dir, or set "
                             "checkpoint.resume=force to continue under the new ones")
        shape = changes and drafter_shape_change(checkpoint_config(path), self.drafter_config, self.target.config)
        if shape:
            detail = "; ".join([shape, *(c for c in changes if c.startswith("drafter."))])
            raise ValueError(f"checkpoint.resume=force cannot continue {path}: the drafter changed shape ({detail}); "
                             "resume with the checkpoint's drafter settings, or pick a new output_dir to train a "
                             "new drafter")
        fresh = self.backend.optimizer_settings()
        self.state = load_checkpoint(self.backend, path, self.slice.global_batch)
        self.state.target_weights = self.target_weights  # the next checkpoint records what it trained with
        if changes:
            # The checkpoint restored its own hyperparameters; the recipe's apply from here on,
            # and the next checkpoint's config.yaml records them.
            self.backend.apply_optimizer_settings(fresh)
            if self.backend.is_main:
                log.warning("checkpoint.resume=force: continuing %s under %d changed settings:", path, len(changes))
            for change in changes:
                log.warning("  %s", change)
        if self.backend.is_main:
            log.info("resumed from %s (step %d, %d samples seen)", path, self.state.step, self.state.samples_seen)

    def _record_init_map(self) -> None:
        """The weights drafter.init_from_target copied, as a file: one log line says where."""
        if not self.copied_from_target:
            return
        path = self.output_dir / INIT_MAP_FILE
        atomic_write_text(path, json.dumps(self.copied_from_target, indent=1) + "\n")
        log.info("drafter initialised from %s: %d tensors copied (the map: %s)",
                 init_summary(self.copied_from_target), len(self.copied_from_target), path)

    def check_can_train(self) -> None:
        """Refuse, in one line, a trainer that can validate but not train. Not at construction:
        a CPU trainer with flex masks still validates (forward only)."""
        if self.cfg.drafter.attention == "flex" and self.backend.device.type == "cpu":
            raise ValueError("drafter.attention=flex cannot train on the CPU (flex attention has no CPU backward): "
                             "add drafter.attention=dense")

    def fit(self) -> Path | None:
        """Train to the end (resuming if possible), export; returns the export directory on rank 0."""
        cfg = self.cfg
        self.check_can_train()
        self.resume()
        if self.backend.is_main:
            mark_output_dir(self.output_dir)  # before anything else is written there
            self._record_init_map()
        if self.backend.is_main and self.manifest is not None:
            # Kept beside the checkpoints: dflash-export writes it into the model card.
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / MANIFEST_COPY).write_text(json.dumps(self.manifest, indent=2, sort_keys=True))
        logger = MetricsLogger(cfg.logging, self.output_dir, self.last_step, self.state.step,
                               self.backend.is_main, as_dict(cfg))
        window = MetricWindow(self.positions, flops.measure_matmul_flops(self.backend.device))
        try:
            while self.state.step < self.last_step:
                start = time.perf_counter()
                sums = self.train_step(self.state.step)
                self.state.step += 1
                self._count_nonfinite(sums["finite"])
                window.add(sums, time.perf_counter() - start)
                logger.advance()
                step = self.state.step
                validate = self._validation_due(step)
                if step % cfg.logging.every == 0 or step == self.last_step or validate:
                    metrics = window.summary(self.backend.lr(), self.state.nan_skipped,
                                             self.slice.world_size, self.backend.device)
                    if validate:
                        metrics.update(self.validate())
                    logger.log(step, metrics)
                    window.reset()
                if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step < self.last_step:
                    self.save()
            self.save()
            self.finish_checkpoint()  # before the export: the last write's error ends the run here
        finally:
            logger.close()
            if self.checkpoints is not None:
                self.checkpoints.close()  # after an error above: the write in flight still completes
        return self.export(self.output_dir / EXPORT_DIR) if cfg.export else None

    def _count_nonfinite(self, finite: bool) -> None:
        if finite:
            return
        self.state.nan_skipped += 1
        log.warning("step %d: non-finite loss or gradients, update skipped (%d so far)",
                    self.state.step, self.state.nan_skipped)
        if self.state.nan_skipped > self.cfg.max_nan_skips:
            raise NonFiniteLossError(
                f"{self.state.nan_skipped} steps had a non-finite loss or gradients "
                f"(max_nan_skips={self.cfg.max_nan_skips}); lower the learning rate or check the data"
            )

    def save(self) -> Path:
        """Collective: checkpoints the current step (in the background with checkpoint.async_write)."""
        waited = self.finish_checkpoint()  # the previous one is in place before the folder is read
        if waited > SLOW_WRITE_S and self.backend.is_main:
            log.info("waited %.1f s for the previous checkpoint's background write to finish", waited)
        latest = latest_checkpoint(self.output_dir)
        if latest is not None and latest.name == step_dir_name(self.state.step) and checkpoint_problem(latest) is None:
            return latest  # resumed at the very end: nothing new to write
        return save_checkpoint(self.backend, self.output_dir, self.state, self.cfg, self.cfg.checkpoint.keep_last,
                               self.checkpoints)

    def finish_checkpoint(self) -> float:
        """Collective: the checkpoint written in the background is published, or its error
        raised here; returns the seconds the main process waited for it."""
        waited = self.checkpoints.wait() if self.checkpoints is not None else 0.0
        self.backend.barrier()
        return waited

    def export(self, out_dir: Path) -> Path | None:
        """Collective: the drafter in the contract format, with recipe and data manifest beside."""
        state = self.backend.full_state_dict()
        path = None
        if self.backend.is_main:
            extra = model_card_files(as_dict(self.cfg), self.manifest, results_table(self.cfg.hub.eval_results, "hub.eval_results"))
            path = save_drafter(self.drafter, out_dir, extra_files=extra, state_dict=state,
                                target_weights=self.target_weights, prog="dflash-train")
        self.backend.barrier()
        return path
