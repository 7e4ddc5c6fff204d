"""What DFlash2's convolutions cost a compiled decoder layer in memory traffic, on a CPU: a
device-independent proxy for the GPU step (issue 38: DFlash2's drafter forward+backward 123.3 ms
against DFlash's 97.9 ms on one H100, recipe +experiment=qwen25_coder_05b_1xh100).

    OMP_NUM_THREADS=1 python -m benchmarks.dflash2_conv_bytes            # the table below, 2,048 block queries
    OMP_NUM_THREADS=1 python -m benchmarks.dflash2_conv_bytes --queries 512 --runs 3

One decoder layer of the recipe's drafter geometry (Qwen2.5-Coder-0.5B: hidden 896, MLP 4864,
14 heads of 64, 2 KV heads; block 16, conv_kernel_size 2, conv_group_size 16), one row of
``--queries`` block queries over a context of ``--context`` tokens, bf16 activations under CPU
autocast over float32 weights (the single-device trainer's mixed precision), SDPA without a mask
(the trainer uses flex attention: the attention is the same in every variant), each layer
compiled with ``layer.compile()`` as the trainer does. Rows:
  * dflash: DFlash's DecoderLayer (no convolution);
  * dflash2-pad: the convolution's first compiled formulation (each tap's x[i - t] a pad and a
    slice of the block-shaped stream), kept here as ``convolve_pad``;
  * dflash2-roll: the model's taps (a roll and a mask inside each block) under autograd's own
    backward, as ``convolve_roll``;
  * dflash2: the model's ``GroupedDynamicCausalConv.convolve``: the same taps in a custom
    autograd.Function (``_BlockConvolution``) that keeps only x, the deltas and the base kernel
    and forms all taps' kernel gradients in one reduction over G and one over the tokens.
Columns: inductor's kernels generated (forward + backward), its estimate of the bytes those
kernels and the extern ones (matmuls, attention) read and write (``torch._inductor.metrics``,
the scheduler's ``get_read_write_buffers_sizes``: each buffer counted once per kernel), split
forward / backward (each variant is its own module instance, compiled at its first call, and
the counters are reset before it), the bytes autograd keeps for the backward (distinct storages passed to
``saved_tensors_hooks``, parameters excluded), and the CPU milliseconds of one forward+backward
(median of ``--runs``, the variants taking turns).

These are inductor's CPU estimates: a GPU's kernels fuse and tile differently, and only a GPU
run measures the step.
"""

from __future__ import annotations

import argparse
import logging
import time
import types

import torch
import torch.nn.functional as F

from dflash_train.model.dflash import DFlashConfig, DFlashDraftModel
from dflash_train.model.dflash2 import DFlash2Config, DFlash2DraftModel, convolve_blocks

# The one-H100 recipe's drafter (+experiment=qwen25_coder_05b_1xh100, recipes/drafter/b16.yaml).
GEOMETRY = dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
                head_dim=64, vocab_size=1024, num_hidden_layers=4)
BLOCK, TAPS, GROUP = 16, 2, 16


def _parts(conv, x, deltas, side):
    b, q, hidden = x.shape
    width = min(q, conv.block_size)
    xs = x.view(b, q // width, width, conv.groups, conv.group_size)
    delta = deltas[:, :, side].reshape(b, q // width, width, conv.kernel_size, conv.groups, 1)
    base = conv.base_kernel[side].view(conv.kernel_size, conv.groups, conv.group_size)
    return width, xs, delta, base


def convolve_pad(conv, x, deltas, side):
    """``GroupedDynamicCausalConv.convolve`` before the custom autograd.Function (branch conv):
    x[i - t] as a pad of t zero slots in front of each block and a slice, autograd's backward."""
    width, xs, delta, base = _parts(conv, x, deltas, side)
    out = None
    for t in range(conv.kernel_size):
        earlier = xs if t == 0 else F.pad(xs, (0, 0, 0, 0, t, 0))[:, :, :width]
        term = earlier * (base[t] + delta[:, :, :, t]).to(x.dtype)
        out = term if out is None else out + term
    return out.view(x.shape)


def convolve_roll(conv, x, deltas, side):
    """The model's taps (a roll and a mask) under autograd's own backward: what the roll alone gains."""
    width, xs, delta, base = _parts(conv, x, deltas, side)
    return convolve_blocks(xs, delta, base).view(x.shape)


VARIANTS = {"dflash": None, "dflash2-pad": convolve_pad, "dflash2-roll": convolve_roll, "dflash2": None}


def build(variant: str):
    from transformers import AutoConfig

    target = AutoConfig.for_model("qwen2", **GEOMETRY)
    kw = dict(mask_token_id=GEOMETRY["vocab_size"] - 1, num_hidden_layers=1, block_size=BLOCK, target_layer_ids=[1])
    torch.manual_seed(0)
    if variant == "dflash":
        return DFlashDraftModel(DFlashConfig.from_target(target, **kw))
    model = DFlash2DraftModel(DFlash2Config.from_target(target, conv_kernel_size=TAPS, conv_group_size=GROUP, **kw))
    with torch.no_grad():  # away from the identity
        for name, p in model.named_parameters():
            if "conv" in name:
                p.normal_(0, 0.02)
    if VARIANTS[variant] is not None:
        for conv in (model.layers[0].attention_conv, model.layers[0].mlp_conv):
            conv.convolve = types.MethodType(VARIANTS[variant], conv)
    return model


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queries", type=int, default=2048, help="block queries of the one row (a multiple of 16)")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--runs", type=int, default=5, help="timed forward+backward calls per variant (0: no timing)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS))
    args = ap.parse_args(argv)
    import torch._inductor.metrics as metrics

    torch.set_num_threads(1)
    torch._inductor.config.fx_graph_cache = False  # a cache hit would count the backward with the forward
    torch._functorch.config.enable_autograd_cache = False
    logging.getLogger("torch._inductor.compile_fx").setLevel(logging.WARNING)
    logging.getLogger("torch._inductor.compile_fx").propagate = False
    h = GEOMETRY["hidden_size"]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, args.queries, h, generator=gen, dtype=torch.bfloat16).requires_grad_()
    ctx = torch.randn(1, args.context, h, generator=gen, dtype=torch.bfloat16)
    grad = torch.randn(1, args.queries, h, generator=gen, dtype=torch.bfloat16)
    rows, steps = {}, {}
    saved, keep = {}, set()  # what autograd keeps, by storage; the parameters' storages

    def pack(t):
        if t.untyped_storage().data_ptr() not in keep:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def unpack(t):
        return t

    torch._logging.set_logs(inductor_metrics=True, recompiles=True)  # the byte counts; and any recompile, named
    torch._dynamo.reset()
    for variant in args.variants.split(","):
        model = build(variant)
        layer = model.layers[0]
        layer.compile()
        cos, sin = model.rotary_emb(torch.arange(args.context + args.queries)[None], torch.bfloat16)

        def step(layer=layer, cos=cos, sin=sin):
            with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                y = layer(x, ctx, cos, sin, None, None)  # in the hooks it was compiled in: no recompile
            y.backward(grad)
            x.grad = None
            layer.zero_grad(set_to_none=True)

        metrics.reset()  # (no dynamo reset: it would drop the layers compiled before, timed below)
        saved.clear()
        keep.update(p.untyped_storage().data_ptr() for p in model.parameters())
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            y = layer(x, ctx, cos, sin, None, None)
        fwd_bytes, fwd_kernels = metrics.num_bytes_accessed, metrics.generated_kernel_count
        y.backward(grad)
        x.grad = None
        rows[variant] = dict(kernels=metrics.generated_kernel_count, fwd=fwd_bytes,
                             bwd=metrics.num_bytes_accessed - fwd_bytes, saved=sum(saved.values()))
        assert fwd_kernels and metrics.generated_kernel_count > fwd_kernels, f"{variant}: nothing compiled"
        steps[variant] = step
        print(f"{variant}: {rows[variant]}", flush=True)
    print("timing", flush=True)
    times = {v: [] for v in steps}
    for fn in steps.values() if args.runs else ():
        fn()  # untimed
    for _ in range(args.runs):
        for v, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            times[v].append(1e3 * (time.perf_counter() - t0))
    print(f"\none layer, 1 row x {args.queries} block queries, context {args.context}, bf16 autocast on CPU, "
          f"torch {torch.__version__}; inductor's byte estimates (MB = 1e6 bytes)\n")
    print(f"| {'variant':18s} | kernels | fwd MB | bwd MB | fwd+bwd MB | saved MB | CPU ms (median of {args.runs}) |")
    print(f"|{'-' * 20}|--------:|-------:|-------:|-----------:|---------:|------:|")
    for v, r in rows.items():
        ms = f"{sorted(times[v])[len(times[v]) // 2]:5.0f}" if times[v] else "    -"
        print(f"| {v:18s} | {r['kernels']:7d} | {r['fwd'] / 1e6:6.1f} | {r['bwd'] / 1e6:6.1f} | "
              f"{(r['fwd'] + r['bwd']) / 1e6:10.1f} | {r['saved'] / 1e6:8.1f} | {ms} |")
    if "dflash" in rows:
        base = rows["dflash"]
        print("\nthe convolutions' part (the row minus dflash's):")
        for v, r in rows.items():
            if v != "dflash":
                fwd, bwd = (r["fwd"] - base["fwd"]) / 1e6, (r["bwd"] - base["bwd"]) / 1e6
                print(f"  {v:18s} fwd {fwd:6.1f} MB  bwd {bwd:6.1f} MB  fwd+bwd {fwd + bwd:6.1f} MB"
                      f"  saved {(r['saved'] - base['saved']) / 1e6:5.1f} MB")


if __name__ == "__main__":
    main()
