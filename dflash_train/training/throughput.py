"""dflash-bench's work: the timed training steps of a recipe, on its data or random rows, with
a random or real target, cut into phases.

dflash_train/bench.py reads the command line and imports this module only once the
settings passed their checks, so a mistake in them is refused without torch.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from dflash_train.config import TrainConfig
from dflash_train.data.dataset import TrainingData
from dflash_train.distributed.build import build_backend
from dflash_train.errors import RunError
from dflash_train.model.dflash import device_clock
from dflash_train.model.target import TargetModel, load_target, target_dtype
from dflash_train.training import flops
from dflash_train.training.trainer import Trainer

PHASES = ("target_forward", "mask_build", "drafter_fwd_bwd", "loss", "optimizer")


def random_target(config, device: torch.device, dtype: torch.dtype) -> TargetModel:
    """A randomly initialised target built on the meta device, then materialised on ``device``."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():  # parameters on the meta device; buffers (rotary inv_freq) computed as usual
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    # to_empty leaves the buffers uninitialised too: their values are put back below (uninitialised
    # rotary frequencies turned a random target's loss into NaN now and then)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
    model.tie_weights()
    return TargetModel(model)


def random_data(cfg, rows: int, vocab: int) -> TrainingData:
    import datasets

    gen = torch.Generator().manual_seed(0)
    length = cfg.data.max_length
    ids = torch.randint(0, vocab, (rows, length), generator=gen).tolist()
    ds = datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": [[1] * length] * rows})
    # Every row already has max_length tokens and num_anchors blocks: no packing, no padding.
    return TrainingData(ds, max_length=length, packing=False, seed=cfg.seed, shuffle=False,
                        num_anchors=cfg.data.num_anchors, block_size=cfg.drafter.block_size,
                        mask_token_id=cfg.target.mask_token_id, kind=cfg.drafter.kind)


def phase_times(trainer: Trainer, step: int) -> dict[str, float]:
    """One optimizer step cut into phases, each closed by a device sync (seconds)."""
    dev = trainer.backend.device
    out = dict.fromkeys(PHASES, 0.0)
    batches = trainer.micro_batches(step)
    for m, batch in enumerate(batches):
        t0 = device_clock(dev)
        feats, noise, final = trainer.target_inputs(batch)
        t1 = device_clock(dev)
        masks = trainer.masks(batch)
        t2 = device_clock(dev)
        hidden = trainer.draft(batch, feats, noise, masks)
        t3 = device_clock(dev)
        loss = trainer.loss(batch, hidden, final)
        t4 = device_clock(dev)
        trainer.backend.backward(loss.weighted_sum / loss.weight_sum.clamp(min=1.0), sync=m == len(batches) - 1)
        t5 = device_clock(dev)
        out["target_forward"] += t1 - t0
        out["mask_build"] += t2 - t1
        out["drafter_fwd_bwd"] += (t3 - t2) + (t5 - t4)
        out["loss"] += t4 - t3
    t6 = device_clock(dev)
    trainer.backend.step()
    out["optimizer"] = device_clock(dev) - t6
    return out


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _host_stats(trainer: Trainer, first: int, steps: int) -> dict:
    """Totals of what the timed steps held (host-side counts; no device work)."""
    totals = dict.fromkeys(("rows", "conversations", "tokens", "blocks", "supervised"), 0)
    for step in range(first, first + steps):
        for batch in trainer.host_batches(step):
            for k in totals:
                totals[k] += getattr(batch.stats, k)
    return totals


def profile_steps(trainer: Trainer, step: int, steps: int = 1, **options):
    """torch.profiler over ``steps`` training steps from ``step``, CUDA kernels included on a
    GPU; ``options`` go to ``torch.profiler.profile`` (record_shapes, with_stack, ...)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, **options) as prof:
        for s in range(steps):
            trainer.train_step(step + s)
        device_clock(trainer.backend.device)
    return prof


def profile_table(trainer: Trainer, step: int, rows: int = 30) -> str:
    """The kernels of one training step, most device time first (torch.profiler)."""
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    return profile_steps(trainer, step).key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)


def run(trainer: Trainer, steps: int, warmup: int) -> dict:
    trainer.check_can_train()
    dev = trainer.backend.device
    val = trainer.val_data is not None
    for s in range(warmup):  # compile, allocator growth, kernel autotuning
        trainer.train_step(s)
    if val:
        trainer.validate()  # the no-grad graphs compile here, once
    graphs_after_warmup = compiled_graphs()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    start = device_clock(dev)
    sums = [trainer.train_step(warmup + s) for s in range(steps)]
    seconds = device_clock(dev) - start
    skipped = sum(not s["finite"] for s in sums)
    if skipped:
        # A skipped update leaves out the optimizer's pass over the weights: such a step is
        # faster than a real one, and its rate is not a training rate.
        raise RunError(f"{skipped} of the {steps} timed steps had a non-finite loss or gradient norm and skipped "
                       "their update: the timing would not be of training steps (check the kernel options, "
                       "dtype and learning rate)")
    val_s = None
    if val:
        t0 = device_clock(dev)
        trainer.validate()
        val_s = device_clock(dev) - t0
    recompiled = compiled_graphs() - graphs_after_warmup
    phases = [phase_times(trainer, warmup + steps + s) for s in range(steps)]
    held = _host_stats(trainer, warmup, steps)
    shape = trainer.data.fixed_shape
    ranks = trainer.slice.world_size
    peak = flops.measure_matmul_flops(dev)
    result = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "world_size": ranks,
        "global_batch": trainer.slice.global_batch,
        "seq_len": trainer.data.max_length,
        "fixed_shape": list(shape) if shape else None,
        "queries_per_row": (shape[1] if shape else trainer.cfg.data.num_anchors) * trainer.drafter.block_size,
        "step_s": seconds / steps,
        "rows_per_s": trainer.slice.global_batch * steps / seconds,
        # host counts are this rank's; ranks hold equal shares of a step's rows
        "samples_per_s": held["conversations"] * ranks / seconds,
        "tokens_per_s": sum(float(s["tokens"]) for s in sums) / seconds,
        "supervised_tokens_per_s": held["supervised"] * ranks / seconds,
        "conversations_per_row": held["conversations"] / held["rows"],
        # The timed steps draw few rows; the data set's own mean gives the steady rate.
        "data_conversations_per_row": len(trainer.data.indices) / len(trainer.data),
        "token_fill": held["tokens"] / (held["rows"] * shape[0]) if shape else None,
        "block_fill": held["blocks"] / (held["rows"] * shape[1]) if shape else None,
        "phase_ms": {k: 1000 * sum(p[k] for p in phases) / steps for k in PHASES},
        "peak_memory_gib": flops.peak_memory_gib(dev),
        "drafter_params_m": sum(p.numel() for p in trainer.drafter.parameters()) / 1e6,
        "drafter_kind": trainer.cfg.drafter.kind,  # dspark: its loss also runs the target to its head
        "graphs_compiled_after_warmup": recompiled,
    }
    result["samples_per_s_at_data_mean"] = result["rows_per_s"] * result["data_conversations_per_row"]
    if val_s is not None:
        every = trainer.cfg.data.val_every or trainer.last_step
        result.update(validation_s=val_s, validation_rows=len(trainer.val_data), validation_every=every,
                      samples_per_s_with_validation=held["conversations"] * ranks / (seconds + val_s * steps / every))
    if peak:
        step_flops = sum(float(s["flops"]) for s in sums) / steps
        result.update(matmul_tflops=peak / 1e12, step_tflop=step_flops / 1e12,
                      mfu=step_flops / (seconds / steps) / (peak * ranks))
    return result


def measure(cfg: TrainConfig, config, real_data: bool, profile: Callable[[Trainer, int], str]) -> tuple[dict, bool]:
    """(the result, whether this is the main process): the timed steps, after building the
    backend, the target (``config``: a random one of that shape) and the data. ``cfg`` is
    dflash-bench's BenchConfig (a recipe with its bench section); ``profile(trainer, step)``
    gives the text bench.profile holds."""
    opts = cfg.bench
    backend = build_backend(cfg.backend)
    if config is not None:
        dtype = torch.bfloat16 if backend.device.type == "cuda" else torch.float32
        target = random_target(config, backend.device, dtype)
    else:
        target = load_target(cfg.target.name, dtype=target_dtype(cfg.target.dtype, backend.device))
    data = None
    if not real_data:
        global_batch = cfg.optim.micro_batch_size * cfg.optim.grad_accum_steps * backend.world_size
        data = random_data(cfg, global_batch * (opts.warmup + 2 * opts.steps), target.vocab_rows)
    trainer = Trainer(cfg, backend=backend, target=target, data=data)
    try:
        result = run(trainer, opts.steps, opts.warmup)
        if opts.profile:
            Path(opts.profile).write_text(profile(trainer, opts.warmup + 2 * opts.steps))
    finally:
        trainer.backend.shutdown()
    return result, trainer.backend.is_main
