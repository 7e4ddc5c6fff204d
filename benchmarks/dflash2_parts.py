"""DFlash2's two training additions, each against its first formulation and against DFlash:
the block-local convolutions around a sublayer, and the candidate selector's loss.

    python -m benchmarks.dflash2_parts                # CPU: a small geometry, float32, eager and compiled
    python -m benchmarks.dflash2_parts --qwen3-8b     # a GPU: Qwen3-8B's drafter and head, bf16
    python -m benchmarks.dflash2_parts --qwen25-05b   # a GPU: the one-H100 recipe's (Qwen2.5-Coder-0.5B), one row

Each row is the forward and backward of one part, median milliseconds:
  * convolution: one residual sublayer of a DFlash2 layer, x + conv(f(conv(norm(x)))), with the
    layer's norm and convolution and a pointwise f (SiLU) for the MLP, whose matmuls are the
    same with and without convolutions: DFlash's (no convolution), the first formulation
    (`wrap_reference`: both sides' kernels widened to (b, Q, 2, Kc, H), masked shifts) and
    the model's (`GroupedDynamicCausalConv.wrap`). A drafter runs 2 such wraps per layer.
  * loss: the DFlash loss alone (DFlash), plus the first selector term
    (`selector_term_reference`: a second pass of the head over every supervised slot for its
    top-K, the candidates' logits from their gathered (M, K, H) head rows), plus the model's
    (the candidates kept by the DFlash loss's own walk, `dflash_loss(top_k=K)`).
The two first formulations are the references the tests hold the model's to
(tests/unit/test_dflash2_equivalence.py). Also printed: the FLOPs and bytes the new ones avoid,
counted from the shapes. On a CPU the times are CPU times; only a GPU run says what a GPU step gains.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from dflash_train.contract import IGNORE_INDEX
from dflash_train.model.dflash2 import DFlash2Config, DFlash2DraftModel
from dflash_train.training.loss import dflash_loss, selector_term, soft_target_index

# The drafter of the measurement (benchmarks/kinds-h100-2026-11-27): one row of 3,072
# tokens, 512 blocks of 16 (8,192 slots), Qwen3-8B's head; and a small one for a CPU.
GEOMETRIES = {
    "qwen3-8b": dict(hidden=4096, intermediate=12288, heads=32, vocab=151936, seq=3072, blocks=512),
    # one of the two rows of a step of the one-H100 recipe (+experiment=qwen25_coder_05b_1xh100)
    "qwen25-05b": dict(hidden=896, intermediate=4864, heads=14, kv_heads=2, vocab=151936, seq=3072, blocks=1920),
    "small": dict(hidden=512, intermediate=1536, heads=8, vocab=32768, seq=1024, blocks=128),
}
BLOCK, TAPS, GROUP, RANK, TOP_K, CHUNK = 16, 2, 16, 256, 16, 1024  # the recipes' values (recipes/drafter/b16.yaml)


def wrap_reference(conv, sublayer, h: torch.Tensor) -> torch.Tensor:
    """The first formulation of ``GroupedDynamicCausalConv.wrap``: both sides' kernels widened
    to (b, Q, 2, Kc, H), and each tap's x[i - t] a shift of the whole stream with the slots
    before the block masked to zero."""
    q = h.shape[1]
    delta = conv.kernel_projection(h).view(*h.shape[:2], 2, conv.kernel_size, conv.groups)
    kernels = (delta.repeat_interleave(conv.group_size, dim=-1) + conv.base_kernel).to(h.dtype)
    slot = torch.arange(q, device=h.device) % conv.block_size

    def convolve(x, side):
        out = x * kernels[:, :, side, 0]
        for t in range(1, conv.kernel_size):
            earlier = F.pad(x, (0, 0, t, 0))[:, :q].masked_fill((slot < t)[None, :, None], 0.0)
            out = out + earlier * kernels[:, :, side, t]
        return out

    return convolve(sublayer(convolve(h, 0)), 1)


def selector_term_reference(model, hidden, labels, input_ids, anchors, lm_head, weights, chunk_size):
    """The first formulation of ``selector_term``: a second pass of the head over every
    supervised slot for its top-K, and the candidates' unary logits from their gathered
    (M, K, H) head rows; ``weights`` (M,): each supervised slot's. Returns (the term, how many
    slots have their gold among the top-K)."""
    block = model.block_size
    index = (labels.flatten() != IGNORE_INDEX).nonzero().squeeze(1)
    pred = input_ids.flatten()[soft_target_index(index, anchors, block, input_ids.shape[1])]
    h, gold, w = hidden.flatten(0, 1)[index], labels.flatten()[index], weights
    head_w, head_b = lm_head.weight, lm_head.bias
    h = h.to(head_w.dtype)
    with torch.no_grad():
        cand = torch.cat([F.linear(h[i:i + chunk_size], head_w, head_b).topk(model.selector_top_k).indices
                          for i in range(0, h.shape[0], chunk_size)])
    unary = torch.einsum("mh,mkh->mk", h, head_w[cand]).float()
    if head_b is not None:
        unary = unary + head_b[cand].float()
    score = unary + model.candidate_selector(h, pred, cand)
    match = cand == gold[:, None]
    covered = match.any(dim=1)
    ce = F.cross_entropy(score, match.float().argmax(dim=1), reduction="none")
    return (ce * w * covered).sum(), int(covered.sum())


def call_ms(fn, device: torch.device) -> float:
    """Milliseconds of one call of ``fn`` (CUDA events on a GPU)."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end)


def medians(fns: dict, device: torch.device, runs: int) -> dict[str, tuple[float, float | None]]:
    """{name: (median ms, peak GiB on a GPU else None)} of each ``fns[name]()``, after two
    untimed calls (compilation); the timed calls take turns, so a busy host slows all alike."""
    peaks = {}
    for name, fn in fns.items():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        fn(), fn()
        peaks[name] = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    times = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            times[name].append(call_ms(fn, device))
    return {name: (sorted(t)[runs // 2], peaks[name]) for name, t in times.items()}


def build(g: dict, device: torch.device) -> DFlash2DraftModel:
    """A one-layer DFlash2 drafter of geometry ``g`` (float32 master weights, as training keeps)."""
    from transformers import AutoConfig

    kv_heads = g.get("kv_heads", max(1, g["heads"] // 4))
    target = AutoConfig.for_model("qwen3", hidden_size=g["hidden"], intermediate_size=g["intermediate"],
                                  num_attention_heads=g["heads"], num_key_value_heads=kv_heads,
                                  head_dim=128 if g["hidden"] >= 4096 else 64, vocab_size=g["vocab"],
                                  num_hidden_layers=4)
    config = DFlash2Config.from_target(target, mask_token_id=g["vocab"] - 1, num_hidden_layers=1, block_size=BLOCK,
                                       target_layer_ids=[1], conv_kernel_size=TAPS, conv_group_size=GROUP,
                                       selector_rank=RANK, selector_top_k=TOP_K)
    torch.manual_seed(0)
    model = DFlash2DraftModel(config).to(device)
    with torch.no_grad():  # away from the identity, so the kernels are not trivially 1 and 0
        for name, p in model.named_parameters():
            if "conv" in name or "successor" in name:
                p.normal_(0, 0.02)
    return model


def conv_rows(model, g: dict, device: torch.device, runs: int, compiled: bool) -> dict[str, tuple]:
    """x + wrap(norm(x)) with the layer's norm and MLP convolution around SiLU, a pointwise
    stand-in for the sublayer: the matmuls of a real one are the same with and without the
    convolutions, and on a CPU they would bury them."""
    layer = model.layers[0]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(1, g["blocks"] * BLOCK, g["hidden"], device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    wraps = {"dflash": F.silu, "dflash2, first": lambda h: wrap_reference(layer.mlp_conv, F.silu, h),
             "dflash2": lambda h: layer.mlp_conv.wrap(F.silu, h)}
    steps = {}
    for name, wrap in wraps.items():
        def sublayer(x, wrap=wrap):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                return x + wrap(layer.post_attention_layernorm(x))
        fn = torch.compile(sublayer, dynamic=False) if compiled else sublayer
        steps[name] = lambda fn=fn: fn(x).backward(grad)
    return medians(steps, device, runs)


def loss_rows(model, g: dict, device: torch.device, runs: int) -> dict[str, tuple]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    head = torch.nn.Linear(g["hidden"], g["vocab"], bias=False, device=device, dtype=dtype).requires_grad_(False)
    gen = torch.Generator(device=device).manual_seed(0)
    q = g["blocks"] * BLOCK
    hidden = torch.randn(1, q, g["hidden"], device=device, dtype=dtype, generator=gen).requires_grad_()
    labels = torch.randint(0, g["vocab"], (1, q), device=device, generator=gen)
    labels[:, ::BLOCK] = IGNORE_INDEX  # slot 0, the anchor
    anchors = torch.randperm(g["seq"] - BLOCK, device=device, generator=gen)[:g["blocks"]].sort().values[None] + 1
    input_ids = torch.randint(0, g["vocab"], (1, g["seq"]), device=device, generator=gen)
    weights = torch.linspace(1.0, 0.3, BLOCK, device=device)
    index = (labels.flatten() != IGNORE_INDEX).nonzero().squeeze(1)

    def step(kind):
        out = dflash_loss(hidden, labels, head, weights, CHUNK, index=index, top_k=TOP_K if kind == "dflash2" else 0)
        total = out.weighted_sum
        rows = (model, hidden, labels, input_ids, anchors, head)
        if kind == "dflash2":
            total = total + selector_term(*rows, out.candidates, index)[0]
        elif kind == "dflash2, first":
            total = total + selector_term_reference(*rows, weights[index % q % BLOCK], CHUNK)[0]
        total.backward()
        hidden.grad = None
        model.zero_grad(set_to_none=True)

    return medians({kind: lambda kind=kind: step(kind) for kind in ("dflash", "dflash2, first", "dflash2")},
                   device, runs)


def avoided(g: dict, head_bytes: int) -> list[str]:
    """What the new formulations no longer compute or write, counted from the shapes."""
    slots = g["blocks"] * (BLOCK - 1)  # every slot but the anchor supervised
    q, h, v = g["blocks"] * BLOCK, g["hidden"], g["vocab"]
    widened = q * 2 * TAPS * h  # one convolution's (b, Q, 2, Kc, H) kernels
    selector = (f"selector: a second head pass over {slots:,} slots, {2 * slots * v * h / 1e12:.2f} TFLOP and "
                f"{slots * v * head_bytes / 1e9:.2f} GB of logits written; {slots * TOP_K * h * head_bytes / 1e9:.2f} "
                "GB of gathered head rows written and kept for the backward (the top-K now comes from the DFlash "
                "loss's logits, the backward sums the K rows with embedding_bag)")
    conv = (f"convolution: {widened / 1e6:.0f}M kernel values ({widened * head_bytes / 1e6:.0f} MB in the compute "
            f"dtype, more in float32 under autocast) a wrap, 2 wraps a layer, no longer widened from "
            f"{widened // GROUP / 1e6:.2f}M predicted ones; no block-start mask pass (the shift pads inside the block)")
    return [selector, conv]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--qwen3-8b", action="store_true", help="the issue's geometry (a GPU)")
    p.add_argument("--qwen25-05b", action="store_true", help="the one-H100 recipe's geometry, one row (a GPU)")
    p.add_argument("--runs", type=int, default=None, help="timed calls per row (default: 10 on a GPU, 5 on a CPU)")
    p.add_argument("--eager-only", action="store_true", help="skip the compiled convolution rows")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = GEOMETRIES["qwen3-8b" if args.qwen3_8b else "qwen25-05b" if args.qwen25_05b else "small"]
    runs = args.runs or (10 if device.type == "cuda" else 5)
    model = build(g, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(f"{name}; hidden {g['hidden']}, vocab {g['vocab']:,}, {g['blocks'] * BLOCK:,} block queries, "
          f"{'bf16 autocast' if device.type == 'cuda' else 'float32'}; median ms of {runs} forward+backward calls")
    print("| part | dflash ms | dflash2 first ms | dflash2 ms | added: first | added: now | peak GiB (3 columns) |")
    print("|---|---|---|---|---|---|---|")
    parts = [("convolution wrap, eager", lambda: conv_rows(model, g, device, runs, False))]
    if not args.eager_only:
        parts.append(("convolution wrap, compiled", lambda: conv_rows(model, g, device, runs, True)))
    parts.append(("loss with the selector", lambda: loss_rows(model, g, device, runs)))
    for part, rows in parts:
        r = rows()
        ms = [r[k][0] for k in ("dflash", "dflash2, first", "dflash2")]
        peak = " / ".join("-" if r[k][1] is None else f"{r[k][1]:.2f}" for k in ("dflash", "dflash2, first", "dflash2"))
        print(f"| {part} | {ms[0]:.1f} | {ms[1]:.1f} | {ms[2]:.1f} | {ms[1] - ms[0]:+.1f} | {ms[2] - ms[0]:+.1f} | "
              f"{peak} |")
    for line in avoided(g, 2 if device.type == "cuda" else 4):
        print("avoided: " + line)


if __name__ == "__main__":
    main()
