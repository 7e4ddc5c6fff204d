"""Training throughput benchmark: N steps of a recipe on a dataset's own rows, or on random rows.

    python -m dflash_train.bench +experiment=qwen25_coder_05b_1xh100 data.path=DIR bench.random_target=true
    python -m dflash_train.bench +experiment=qwen3_8b_8xh100 bench.random_target=true bench.target_layers=36
    python -m dflash_train.bench --config-name train_quickstart bench.steps=3

Settings are overrides of a training recipe (recipes/train.yaml or --config-name NAME) plus
the benchmark's own, under bench. (see ``BenchOptions``). Its flags of before (--steps N,
--random-target, ...) are refused with their bench. key=value form.

Prints conversations/s, tokens/s and supervised slots/s (block predictions trained) of the
real training step, a per-phase breakdown (target forward, mask build, drafter
forward+backward, loss, optimizer) timed with device syncs, MFU against this GPU's measured
bf16 matmul rate (useful work only: padding is not counted), peak memory, and how many
graphs torch.compile built after warm-up (anything but 0 means recompilation on this data).
Any ``drafter.kind`` runs (its own loss is part of the step); the MFU counts the DFlash
backbone's FLOPs only, so a DFlash2 drafter's convolutions and selector are not in it.

With ``data.path=DIR`` the recipe runs on that dataset exactly as training would: its row
lengths, loss masks, packing and fixed shapes, and its validation (one validation pass is
timed and amortised over ``data.val_every`` steps). Without it, rows are random and full
length (``data.max_length`` tokens, every position supervised, so every row has
``num_anchors`` blocks): the worst case a recipe allows.

With ``bench.random_target=true`` the target is built from its config alone, randomly initialised
straight on the device (meta-device construction through accelerate, no weights read):
timing does not depend on the weights, and an 8B target starts in seconds. The configs of
the paper's targets are built in, so this works offline.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash_train.config import TrainConfig, validate
from dflash_train.data.dataset import TrainingData
from dflash_train.distributed.build import build_backend
from dflash_train.errors import RunError, check_writable_dir, run_command
from dflash_train.model.dflash import device_clock
from dflash_train.model.target import TargetModel, load_target, resolve_target, target_dtype
from dflash_train.recipe import compose_recipe, parse_command_line, to_config
from dflash_train.run_lock import hold_folder
from dflash_train.training import flops
from dflash_train.training.trainer import Trainer

# Public architecture configs of the paper's targets, so a random-weight benchmark needs no hub.
_QWEN3 = dict(model_type="qwen3", vocab_size=151936, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
              rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960, hidden_act="silu")
GEOMETRIES = {
    "Qwen/Qwen3-8B": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                          tie_word_embeddings=False),
    "Qwen/Qwen3-4B": dict(_QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                          tie_word_embeddings=True),
    "meta-llama/Llama-3.1-8B-Instruct": dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=131072, tie_word_embeddings=False),
    "Qwen/Qwen2.5-Coder-0.5B-Instruct": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=32768, tie_word_embeddings=True),
    "Qwen/Qwen2.5-7B-Instruct": dict(
        model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=32768, tie_word_embeddings=False),
}
PHASES = ("target_forward", "mask_build", "drafter_fwd_bwd", "loss", "optimizer")
OPTIONS = "bench"  # the section of the benchmark's own settings


@dataclass
class BenchOptions:
    steps: int = 5  # timed optimizer steps
    warmup: int = 2  # untimed steps first (compilation, allocator growth, autotuning)
    random_target: bool = False  # random weights from the target's config
    target_layers: int | None = None  # build the random target with this many layers
    json: str | None = None  # also write the result here
    profile: str | None = None  # write one step's kernel table here


@dataclass
class BenchConfig(TrainConfig):
    """A training recipe and the benchmark's own options."""

    bench: BenchOptions = field(default_factory=BenchOptions)


def validate_bench(cfg: BenchConfig) -> None:
    validate(cfg)
    b = cfg.bench
    if b.steps < 1 or b.warmup < 0:
        raise ValueError(f"bench.steps={b.steps} must be >= 1 and bench.warmup={b.warmup} >= 0")
    if b.target_layers is not None and not b.random_target:
        raise ValueError(f"bench.target_layers={b.target_layers} needs bench.random_target=true")
    for key, path, ours in (("bench.json", b.json, _is_result), ("bench.profile", b.profile, _is_profile)):
        if path is not None and Path(path).exists() and not (Path(path).is_file() and ours(Path(path))):
            raise ValueError(f"{key}={path} exists and is not an earlier dflash-bench {key.split('.')[1]}: it is "
                             "left untouched; name a new file")
        if path is not None:  # before the benchmark runs, not after it
            check_writable_dir(Path(path).absolute().parent, f"the folder of {key}")


PROFILE_HEADER = "# dflash-bench profile: one training step's kernels\n"


def _is_result(path: Path) -> bool:
    """Whether ``path`` holds a result this benchmark wrote (bench.json), which it may replace."""
    try:
        return "samples_per_s" in json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError, TypeError):
        return False


def _is_profile(path: Path) -> bool:
    try:
        return path.read_text().startswith(PROFILE_HEADER)
    except (OSError, UnicodeDecodeError):
        return False


# The benchmark's flags before it took key=value settings: refused, naming what replaced each.
RETIRED_FLAGS = {"--steps": "bench.steps=N", "--warmup": "bench.warmup=N",
                 "--random-target": "bench.random_target=true", "--target-layers": "bench.target_layers=N",
                 "--json": "bench.json=FILE", "--profile": "bench.profile=FILE"}


def target_config(name: str, num_layers: int | None):
    from transformers import AutoConfig

    if name in GEOMETRIES:
        fields = dict(GEOMETRIES[name])
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    else:
        config = AutoConfig.from_pretrained(resolve_target(name))
    if num_layers is not None:
        config.num_hidden_layers = num_layers
    return config


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


def format_result(r: dict) -> str:
    lines = [
        f"device {r['device']} x{r['world_size']}  global batch {r['global_batch']} rows of {r['seq_len']} tokens, "
        f"{r['queries_per_row']} block queries per row, {r['drafter_kind']} drafter "
        f"{r['drafter_params_m']:.1f}M params",
        f"step {r['step_s'] * 1000:.1f} ms  {r['samples_per_s']:.2f} samples/s (conversations)  "
        f"{r['rows_per_s']:.2f} rows/s  {r['tokens_per_s']:.0f} tokens/s  "
        f"{r['supervised_tokens_per_s']:.0f} supervised slots/s  peak memory {r['peak_memory_gib']:.2f} GiB",
    ]
    if r["fixed_shape"]:
        lines.append(f"fixed shape {r['fixed_shape'][0]} tokens x {r['fixed_shape'][1]} blocks per row: "
                     f"{r['conversations_per_row']:.2f} conversations per row, token fill "
                     f"{100 * r['token_fill']:.1f}%, block fill {100 * r['block_fill']:.1f}%")
        lines.append(f"the data set packs {r['data_conversations_per_row']:.2f} conversations per row: "
                     f"{r['samples_per_s_at_data_mean']:.2f} conversations/s at its mean (the timed steps "
                     f"drew {r['conversations_per_row']:.2f})")
    if "validation_s" in r:
        lines.append(f"validation {r['validation_s']:.2f} s for {r['validation_rows']} rows, every "
                     f"{r['validation_every']} steps: {r['samples_per_s_with_validation']:.2f} samples/s with it")
    if "mfu" in r:
        lines.append(f"MFU {100 * r['mfu']:.1f}% of the measured {r['matmul_tflops']:.0f} TFLOP/s bf16 matmul "
                     f"({r['step_tflop']:.1f} TFLOP per step)")
    lines.append(f"graphs compiled after warm-up: {r['graphs_compiled_after_warmup']}")
    total = sum(r["phase_ms"].values())
    lines.append("phase breakdown (synced):")
    lines += [f"  {k:<16} {v:9.1f} ms  {100 * v / total:5.1f}%" for k, v in r["phase_ms"].items()]
    return "\n".join(lines)


def _bench(cfg: BenchConfig, config, real_data: bool, profile: Callable[[Trainer, int], str]) -> tuple[dict, bool]:
    """(the result, whether this is the main process): the timed steps, after building the
    backend, the target (``config``: a random one of that shape) and the data."""
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
            Path(opts.profile).write_text(PROFILE_HEADER + profile(trainer, opts.warmup + 2 * opts.steps))
    finally:
        trainer.backend.shutdown()
    return result, trainer.backend.is_main


def load(argv: list[str], output_dir: str) -> tuple[BenchConfig, bool]:
    """The benchmark's typed settings from its command line, and whether it reads real data
    (``data.path`` given; otherwise random rows). Its runs write only into ``output_dir``."""
    line = parse_command_line(argv, "train", __doc__, retired=RETIRED_FLAGS)
    # The training recipes have no bench section: its keys are added (``++``: a key given
    # twice takes its last value, as every other key does), then checked by the schema.
    overrides = [f"++{o}" if o.startswith(f"{OPTIONS}.") else o for o in line.overrides]
    real_data = any(o.split("=", 1)[0].lstrip("+") == "data.path" for o in overrides)
    fixed = [f"output_dir={output_dir}", "export=false", "checkpoint.every=0", "logging.wandb=disabled",
             "logging.progress_bar=false", *([] if real_data else ["data.path=random"])]
    return to_config(BenchConfig, compose_recipe(BenchConfig, line.config_name, [*fixed, *overrides])), real_data


def main(argv: list[str] | None = None, profile: Callable[[Trainer, int], str] = profile_table) -> dict:
    """``profile(trainer, step)``: the report ``bench.profile`` writes (benchmarks/profile_step.py
    passes its own)."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg, real_data = load(sys.argv[1:] if argv is None else argv, tmp)
        opts, config = cfg.bench, None
        if opts.random_target:
            config = target_config(cfg.target.name, opts.target_layers)
            cfg.target.num_layers = config.num_hidden_layers
            cfg.data.check_manifest = False  # random weights have no identity to check
        validate_bench(cfg)
        with hold_folder(cfg.output_dir, "output_dir", "dflash-bench"):
            result, is_main = _bench(cfg, config, real_data, profile)
    if is_main:
        print(format_result(result))
        if cfg.bench.json:
            Path(cfg.bench.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    run_command("dflash-bench", main)
