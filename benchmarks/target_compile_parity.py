"""Compiled versus eager target features on real packed rows, layer by layer.

    python -m benchmarks.target_compile_parity +experiment=qwen25_coder_05b_1xh100 \\
        target.name=/tmp/qwen25coder05b.gguf data.path=/tmp/data/sharegpt-qwen25-coder-05b output_dir=/tmp/parity

Builds the trainer's own micro-batches of step 0 (the recipe's fixed shapes, packed rows,
its mask and positions) and runs the frozen target three ways on them: eager in the
recipe's dtype, compiled (``TargetModel.compile_layers``) in that dtype, and eager in
float32 as the reference. For every decoder layer it prints the relative error
(||a - b|| / ||b|| over real tokens) and the largest absolute error of compiled against
eager, and of each against float32; then the same for tokens at document starts (the
first 4 of every packed conversation) and for the conversation that is worst. A structural
difference (a document seeing another, positions not restarting) shows up as errors far
above eager's own distance to float32, concentrated after the first conversation of a row;
rounding shows up as compiled and eager being about as far from float32 as each other.
The attention kernels each forward launched are listed from the profiler.
"""

from __future__ import annotations

import sys
import time

import torch

from dflash_train.config import TrainConfig, validate
from dflash_train.data.packing import PAD_DOC
from dflash_train.model.target import decoder_layers, load_target
from dflash_train.recipe import load_command
from dflash_train.training.trainer import Trainer

DOC_START = 4  # tokens counted as a document's start


def all_layers(target, batch, mask, positions) -> torch.Tensor:
    """Every decoder layer's output but the last (the trainer's hook path): (b, T, L, H) float32."""
    ids = list(range(target.num_layers - 1))
    with torch.inference_mode():
        feats = target.features(batch.input_ids, ids, attention_mask=mask, position_ids=positions)
    b, t, _ = feats.shape
    return feats.float().view(b, t, len(ids), -1)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


VARIANTS = {"compiled": "fused", "compiled+emulate": "eager"}  # target.compile_rounding of each


def layer_table(runs, real, starts) -> None:
    """One row per layer: relative and max errors of each pair, over all real tokens and at starts."""
    pairs = [("eager", "fp32"), *((v, "eager") for v in VARIANTS), *((v, "fp32") for v in VARIANTS)]
    print("| layer | " + " | ".join(f"{a} vs {b}: rel / max / rel at starts" for a, b in pairs) + " |")
    print("|---|" + "---|" * len(pairs))
    for layer in range(runs["eager"].shape[2]):
        cells = []
        for a, b in pairs:
            x, y = runs[a][:, :, layer], runs[b][:, :, layer]
            cells.append(f"{rel(x[real], y[real]):.2e} / {(x[real] - y[real]).abs().max().item():.2e} / "
                         f"{rel(x[starts], y[starts]):.2e}")
        print(f"| {layer} | " + " | ".join(cells) + " |")


def doc_table(batch, runs) -> None:
    """Per conversation (row, order in row, length), at the last layer: each run against fp32 and eager."""
    names = [k for k in runs if k != "fp32"]
    print("\n| row | doc order | tokens | " + " | ".join(f"{k} vs fp32" for k in names) + " | "
          + " | ".join(f"{k} vs eager" for k in names if k != "eager") + " |")
    print("|---|---|---|" + "---|" * (2 * len(names) - 1))
    for r in range(batch.doc_ids.shape[0]):
        docs = [d for d in batch.doc_ids[r].unique().tolist() if d != PAD_DOC]
        docs.sort(key=lambda d: (batch.doc_ids[r] == d).nonzero()[0].item())
        for order, d in enumerate(docs):
            idx = (batch.doc_ids[r] == d).nonzero().flatten()
            vs32 = [f"{rel(runs[k][r, idx, -1], runs['fp32'][r, idx, -1]):.2e}" for k in names]
            vse = [f"{rel(runs[k][r, idx, -1], runs['eager'][r, idx, -1]):.2e}" for k in names if k != "eager"]
            print(f"| {r} | {order} | {idx.numel()} | " + " | ".join(vs32 + vse) + " |")


def attention_kernels(target, batch, mask, positions) -> dict[str, int]:
    """CUDA kernels of one feature forward whose names say attention, softmax or gemm, with counts."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        all_layers(target, batch, mask, positions)
        torch.cuda.synchronize()
    keys = ("attn", "attention", "fmha", "flash", "softmax", "sdpa", "cutlass", "gemm")
    return {e.key[:100]: e.count for e in prof.key_averages() if any(k in e.key.lower() for k in keys)}


def forward_ms(target, batch, mask, positions, repeats: int = 5) -> float:
    """Median milliseconds of the trainer's feature forward (its layer ids) on ``batch``."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        with torch.inference_mode():
            target.features(batch.input_ids, LAYER_IDS, attention_mask=mask, position_ids=positions)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - t0))
    return sorted(times)[len(times) // 2]


LAYER_IDS: list[int] = []


def main(argv: list[str]) -> None:
    cfg = load_command(TrainConfig, [*argv, "target.compile=false", "logging.wandb=disabled"], "train", __doc__,
                       validate)
    trainer = Trainer(cfg)
    LAYER_IDS.extend(trainer.layer_ids)
    batch = trainer.micro_batches(0)[0]
    mask, positions = trainer.target_mask(batch)
    real = batch.doc_ids != PAD_DOC  # (b, T)
    starts = real & (batch.position_ids < DOC_START)
    target = trainer.target
    print(f"rows {tuple(batch.input_ids.shape)}, {int(real.sum())} real tokens, "
          f"{int((batch.position_ids[real] == 0).sum())} conversations, mask {None if mask is None else tuple(mask.shape)}, "
          f"dtype {target.model.dtype}, torch {torch.__version__}, layers {trainer.layer_ids}", flush=True)
    cuda = torch.cuda.is_available()
    runs = {"eager": all_layers(target, batch, mask, positions)}
    timing = {"eager": forward_ms(target, batch, mask, positions)}
    kernels = {"eager": attention_kernels(target, batch, mask, positions)} if cuda else {}
    reference = load_target(cfg.target.name, dtype=torch.float32, device=target.device)
    runs["fp32"] = all_layers(reference, batch, mask, positions)
    del reference
    for name, rounding in VARIANTS.items():
        torch._dynamo.reset()
        target.compile_layers(rounding)
        all_layers(target, batch, mask, positions)  # compile
        runs[name] = all_layers(target, batch, mask, positions)
        timing[name] = forward_ms(target, batch, mask, positions)
        if cuda:
            kernels[name] = attention_kernels(target, batch, mask, positions)
        target.uncompile_layers()
    layer_table(runs, real, starts)
    doc_table(batch, runs)
    print("\n| run | feature forward (ms, median of 5) |\n|---|---|")
    for name, ms in timing.items():
        print(f"| {name} | {ms:.1f} |")
    for name, found in kernels.items():
        print(f"\n{name} kernels (attention, softmax, gemm):")
        for key, count in sorted(found.items(), key=lambda kv: -kv[1]):
            print(f"  {count:5d}  {key}")
    from torch._dynamo.utils import counters

    print("\ndynamo graph breaks:", dict(counters["graph_break"]) or "none",
          "| unique graphs:", counters["stats"].get("unique_graphs"), "| layers:", len(decoder_layers(target.model)))


if __name__ == "__main__":
    main(sys.argv[1:])
