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

from dflash_train.config import TrainConfig, validate
from dflash_train.data.format import read_manifest
from dflash_train.errors import check_writable_dir, run_command
from dflash_train.recipe import compose_recipe, parse_command_line, to_config
from dflash_train.run_lock import hold_folder

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

    from dflash_train.model.target import resolve_target

    if name in GEOMETRIES:
        fields = dict(GEOMETRIES[name])
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    else:
        config = AutoConfig.from_pretrained(resolve_target(name))
    if num_layers is not None:
        config.num_hidden_layers = num_layers
    return config


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


def random_target_layers(name: str, target_layers: int | None) -> int:
    """The layers of the random target: bench.target_layers, else its built-in geometry's,
    else its own config's (read with transformers)."""
    if target_layers is not None:
        return target_layers
    if name in GEOMETRIES:
        return GEOMETRIES[name]["num_hidden_layers"]
    return target_config(name, None).num_hidden_layers


def main(argv: list[str] | None = None, profile: Callable | None = None) -> dict:
    """``profile(trainer, step)``: the report ``bench.profile`` writes (None: the kernel table,
    training/throughput.py's ``profile_table``; benchmarks/profile_step.py passes its own)."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg, real_data = load(sys.argv[1:] if argv is None else argv, tmp)
        opts = cfg.bench
        if opts.random_target:
            cfg.target.num_layers = random_target_layers(cfg.target.name, opts.target_layers)
            cfg.data.check_manifest = False  # random weights have no identity to check
        validate_bench(cfg)
        if real_data:
            read_manifest(cfg.data.path)  # before torch: a folder that is no dataset fails in a second
        from dflash_train.training.throughput import measure, profile_table

        config = target_config(cfg.target.name, opts.target_layers) if opts.random_target else None
        report = profile or profile_table

        def profile_text(trainer, step: int) -> str:
            return PROFILE_HEADER + report(trainer, step)

        with hold_folder(cfg.output_dir, "output_dir", "dflash-bench"):
            result, is_main = measure(cfg, config, real_data, profile_text)
    if is_main:
        print(format_result(result))
        if cfg.bench.json:
            Path(cfg.bench.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    run_command("dflash-bench", main)
