"""A speculative step's costs on a serving-size target, in plain steps (issue 41, item 2).

    python -m benchmarks.serving_step                               # Qwen3-8B geometry, one GPU
    python -m benchmarks.serving_step --batch 1 8 --verify 3 7 15 --compile-draft --json out.json
    python -m benchmarks.serving_step --batch 1 8 --verify 15 --gqa repeat packed --profile DIR
    python -m benchmarks.serving_step --tiny --device cpu --replays 2   # the CPU check of the script

The target is ``--geometry`` (default Qwen/Qwen3-8B; the configs dflash-bench builds in) with
random weights, built as ``dflash-bench bench.random_target=true`` builds it; the drafter is a
fresh one for it (5 layers, block 16, the contract's feature layers). Each row is one batch
size and one verify length k (``verify_tokens``) of the static runtime; after a prompt of
``--prompt`` random tokens per row is prefilled, each of its captured graphs is replayed
``--replays`` times between two CUDA events:
  plain   the target's one-token step (the plain decoding the speedup is over)
  verify  the target's forward over the anchor and k drafts
  draft   the drafter's forward over its whole block (the same at every k)
  step    the whole greedy device-loop step: draft, verify, acceptance, the commit and the
          next draft's context, one graph
  rest    step - draft - verify: acceptance and bookkeeping
each also in plain steps. The weights are random, so the drafter is not accepted as a
trained one is; every shape of a step is fixed (attention reads all cache slots, masked),
so a step costs the same whatever it accepts: this is what the table measures, and it
stands in for a trained drafter. ``x at tau T`` is min(T, k+1) / step: the speedup of a
drafter whose mean acceptance at that k is T (a drafter's tau at k < 15 is below its tau at
15, so for short verifies it is a bound). On a CPU the graphs are eager calls and the
figures are compute time; only the GPU's numbers answer the issue.

``--gqa`` picks how the target's attention serves its grouped-query heads (the runtime's
`GQA_PATHS`; several run one after the other, each row says which). ``--profile DIR`` also
runs the plain step's and each verify's forward (the functions their graphs hold, called
eagerly) under torch.profiler and writes DIR/profile-b{B}-{plain|k{K}}.txt (``-packed``
before ``.txt`` for the packed path): GPU ms a call grouped by what the kernels are for, the
bytes each group moves and its time at HBM bandwidth, and for a verify its comparison with
the plain step (benchmarks/step_profile.py).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from benchmarks.runtime_parts import per_call_ms
from benchmarks.step_profile import (
    StepProfile,
    format_comparison,
    format_profile,
    profile_call,
)
from dflash_train.bench import GEOMETRIES, target_config
from dflash_train.model.dflash import DFlashConfig, DFlashDraftModel
from dflash_train.model.runtime import (
    GQA_PATHS,
    StaticSpeculator,
    TargetSlots,
    static_unsupported,
)
from dflash_train.training.throughput import random_target

DRAFT_LAYERS = 5
BLOCK = 16
# A small Qwen3 for checking the script on a CPU (--tiny): the numbers mean nothing.
TINY = dict(model_type="qwen3", vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1000000.0,
            max_position_embeddings=4096, tie_word_embeddings=False)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving_step", description=__doc__.splitlines()[0])
    p.add_argument("--geometry", default="Qwen/Qwen3-8B", choices=sorted(GEOMETRIES))
    p.add_argument("--tiny", action="store_true", help="a tiny Qwen3 instead of --geometry (CPU check)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--verify", type=int, nargs="+", default=[3, 7, 15], help="verify lengths k, 1..15")
    p.add_argument("--tau", type=float, default=6.5, help="mean acceptance for the speedup column")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens per row")
    p.add_argument("--slots", type=int, default=2048, help="cache slots (every step attends over all of them)")
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--compile-draft", action="store_true", help="the draft step compiled inside its graphs")
    p.add_argument("--gqa", nargs="+", default=[GQA_PATHS[0]], choices=GQA_PATHS,
                   help="the target's grouped-query attention path(s): repeat (transformers' sdpa: K/V copied to "
                        "every query head) and/or packed (a K/V head's query heads stacked, K/V read once)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="also profile the plain step's and each verify's forward: DIR/profile-b{B}-{plain|k{K}}.txt")
    args = p.parse_args(argv)
    bad = [k for k in args.verify if not 1 <= k < BLOCK]
    if bad:
        p.error(f"--verify {bad[0]}: must be in 1..{BLOCK - 1}")
    if min(args.batch) < 1 or args.replays < 1:
        p.error(f"--batch {args.batch} and --replays {args.replays} must be >= 1")
    if args.prompt + 2 * BLOCK + args.replays + 3 > args.slots:
        p.error(f"--slots {args.slots} cannot hold --prompt {args.prompt} and the replayed steps: raise --slots")
    return args


def build(args, device: torch.device):
    """The random target (an HF model) and a fresh drafter for it, in the run's dtype."""
    from transformers import AutoConfig

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.tiny:
        fields = dict(TINY)
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    else:
        config = target_config(args.geometry, None)
    target = random_target(config, device, dtype).model.eval()
    reason = static_unsupported(target)
    if reason is not None:
        raise SystemExit(f"the static runtime cannot serve this target: {reason}")
    cfg = DFlashConfig.from_target(target.config, mask_token_id=target.config.vocab_size - 1,
                                   num_hidden_layers=DRAFT_LAYERS, block_size=BLOCK)
    with torch.device(device):
        drafter = DFlashDraftModel(cfg).to(dtype).eval()
    drafter.compile_static_draft = args.compile_draft
    return target, drafter


def _prompts(target, rows: int, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, target.config.vocab_size - 1, (rows, length), generator=torch.Generator().manual_seed(0))
    return ids.to(device), torch.arange(length, device=device).repeat(rows, 1)


def plain_ms(target, args, rows: int, gqa: str, device) -> tuple[float, TargetSlots]:
    """ms a replay of the plain step, and its `TargetSlots` (for the profile)."""
    plain = TargetSlots(target, args.slots, width=1, rows=rows, gqa=gqa)
    ids, positions = _prompts(target, rows, args.prompt, device)
    plain.forward(ids, positions, logits_to_keep=1)
    plain.positions.fill_(args.prompt)
    return per_call_ms(plain.step, device, args.replays), plain


def speculative_ms(drafter, target, args, rows: int, k: int, gqa: str,
                   device) -> tuple[dict[str, float], StaticSpeculator]:
    """ms a replay of the verify, the draft and the whole device-loop step at verify length k,
    and the runtime (for the profile)."""
    rt = StaticSpeculator(drafter, target, args.slots, rows=rows, verify_tokens=k, gqa=gqa)
    ids, positions = _prompts(target, rows, args.prompt, device)
    _, feats = rt.verifier.forward(ids, positions, logits_to_keep=1)
    width, start = rt.verify_width, torch.full((rows, 1), args.prompt, device=device)
    # the next draft's context: the prompt's last k+1 features, as after a verify there
    rt.ctx_feats.copy_(feats[:, -width:])
    rt.ctx_pos.copy_(positions[:, -width:])
    anchor = ids[:, -1]
    rt.begin(anchor, start, torch.full_like(start, args.slots - 2 * BLOCK), drafter.mask_token_id, [])
    rt.set_block(anchor, start, drafter.mask_token_id)
    times = {"verify": per_call_ms(rt.verify_step, device, args.replays),
             "draft": per_call_ms(rt.draft_step, device, args.replays),
             "step": per_call_ms(rt.greedy_step, device, args.replays)}  # advances from `begin`'s state
    times["rest"] = times["step"] - times["draft"] - times["verify"]
    return times, rt


def weight_reads(target, drafter) -> tuple[int, int]:
    """Parameters a step reads, (target, draft): the target's all but its input embedding (a
    lookup reads a few rows), the drafter's all and the target's LM head, which the draft's
    logits use."""
    target_n = sum(p.numel() for n, p in target.named_parameters() if "embed_tokens" not in n)
    return target_n, sum(p.numel() for p in drafter.parameters()) + target.lm_head.weight.numel()


def bound_line(target, drafter) -> str:
    t, d = weight_reads(target, drafter)
    return (f"weights a step reads: the target {t / 1e6:.3f}M parameters (its embedding aside), the draft "
            f"{d / 1e6:.3f}M (the drafter and the target's LM head): where both are bound by reading weights, "
            f"a whole step is at least the verify + {d / t:.3f} plain steps")


def measure(args) -> list[dict]:
    device = torch.device(args.device)
    target, drafter = build(args, device)
    print(bound_line(target, drafter), flush=True)
    rows = []
    with torch.inference_mode():
        for gqa in args.gqa:
            for batch in args.batch:
                rows += measure_batch(target, drafter, args, batch, gqa, device)
    return rows


def _profile_title(args, batch: int, gqa: str, what: str) -> str:
    name = "tiny Qwen3" if args.tiny else f"{args.geometry} geometry"
    return (f"{name}, batch {batch}, {what}, gqa {gqa}; {args.prompt}-token prompts, attention over {args.slots} "
            "cache slots")


def _profile_name(batch: int, part: str, gqa: str) -> str:
    """profile-b{B}-{part}.txt for the default GQA path, profile-b{B}-{part}-{gqa}.txt for another."""
    return f"profile-b{batch}-{part}" + ("" if gqa == GQA_PATHS[0] else f"-{gqa}") + ".txt"


def profile_plain(target, slots: TargetSlots, args, batch: int, gqa: str, replay_ms: float, device) -> StepProfile:
    """The plain step's forward (the function its graph holds) profiled, to DIR/profile-b{B}-plain.txt."""
    title = _profile_title(args, batch, gqa, "plain one-token step")
    prof = profile_call(slots.step.fn, target, device, title, replay_ms)
    _write(args.profile, _profile_name(batch, "plain", gqa), format_profile(prof))
    return prof


def profile_verify(target, rt: StaticSpeculator, args, batch: int, k: int, gqa: str, replay_ms: float,
                   plain: StepProfile, device) -> StepProfile:
    """The verify's forward profiled, with the comparison to the plain step, to DIR/profile-b{B}-k{K}.txt."""
    title = _profile_title(args, batch, gqa, f"verify of k={k} drafts ({k + 1} tokens a row)")
    prof = profile_call(rt.verify_step.fn, target, device, title, replay_ms)
    text = format_profile(prof) + "\n" + format_comparison(plain, prof, f"verify k={k}")
    _write(args.profile, _profile_name(batch, f"k{k}", gqa), text)
    return prof


def _write(folder: str, name: str, text: str) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, name), "w") as f:
        f.write(text)
    print(f"wrote {os.path.join(folder, name)}", flush=True)


def measure_batch(target, drafter, args, batch: int, gqa: str, device) -> list[dict]:
    """The rows of one batch size and GQA path: the plain step, then each k (and their profiles)."""
    rows = []
    plain, slots = plain_ms(target, args, batch, gqa, device)
    plain_profile = profile_plain(target, slots, args, batch, gqa, plain, device) if args.profile else None
    del slots
    for k in args.verify:
        ms, rt = speculative_ms(drafter, target, args, batch, k, gqa, device)
        step = ms["step"] / plain  # the whole step in plain steps
        rows.append({"gqa": gqa, "batch": batch, "k": k, "plain_ms": plain, **{f"{n}_ms": v for n, v in ms.items()},
                     "step_plain": step, "speedup_at_tau": min(args.tau, k + 1) / step})
        print(format_row(rows[-1]), flush=True)
        if args.profile:
            profile_verify(target, rt, args, batch, k, gqa, ms["verify"], plain_profile, device)
        del rt
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the runtime's buffers and graphs go with it
    return rows


def header(args, device: torch.device) -> str:
    name = "tiny Qwen3" if args.tiny else f"{args.geometry} geometry"
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    draft = "compiled" if args.compile_draft else "eager"
    lines = [f"{name}, random {dtype} weights, {card}; drafter {DRAFT_LAYERS} layers, block {BLOCK}, draft {draft}; "
             f"{args.prompt}-token prompts, {args.slots} cache slots, {args.replays} replays per graph",
             "random drafter: every shape is fixed, so a step costs the same whatever it accepts (it stands in "
             "for a trained drafter); ms per replay, (in plain steps)",
             f"{'gqa':>6} {'batch':>5} {'k':>3} {'plain ms':>9} {'verify':>15} {'draft':>15} {'rest':>15} {'step':>15} "
             f"{f'x at tau {args.tau:g}':>13}"]
    return "\n".join(lines)


def format_row(r: dict) -> str:
    cells = [f"{r[f'{n}_ms']:7.3f} ({r[f'{n}_ms'] / r['plain_ms']:4.2f})" for n in ("verify", "draft", "rest", "step")]
    head = f"{r['gqa']:>6} {r['batch']:>5} {r['k']:>3} {r['plain_ms']:>9.3f}"
    return " ".join([head, *(f"{c:>15}" for c in cells), f"{r['speedup_at_tau']:>12.2f}x"])


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    print(header(args, torch.device(args.device)), flush=True)
    rows = measure(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
