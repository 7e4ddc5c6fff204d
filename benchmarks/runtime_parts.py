"""Device time of each captured graph of the static runtime, eager and compiled, in plain steps.

    python -m benchmarks.runtime_parts target=qwen25_coder_05b target.name=/tmp/qwen25coder05b.gguf \\
        target.dtype=bfloat16 device=cuda drafter_path=random

The config is dflash-eval's. One prompt of `PROMPT_LEN` random tokens is prefilled, then each
graph is replayed `REPLAYS` times at fixed positions and timed with CUDA events: the plain
one-token step, the 16-token verify, the draft, and the whole greedy device-loop step. Then
the same with the draft compiled (`compile_drafter`) and with the target's forward compiled
too (`torch.compile`, fixed shapes; not a runtime option: it changes the target's rounding,
so it is measured here only). A speculative step's cost in plain steps bounds the speedup at
tau t to t / cost. On a CPU the graphs are eager calls and the figures are compute time.
"""

from __future__ import annotations

import time

import torch

from dflash_train.errors import run_command
from dflash_train.eval.job import setup
from dflash_train.eval.settings import EvalConfig, validate
from dflash_train.model.runtime import StaticSpeculator, TargetSlots
from dflash_train.recipe import load_command

PROMPT_LEN = 200
REPLAYS = 50  # on a CPU pass fewer: per_call_ms(..., replays)
SLOTS = 1024


def per_call_ms(fn, device, replays: int = REPLAYS) -> float:
    """Milliseconds a call of ``fn``, after two untimed calls (capture)."""
    fn(), fn()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(replays):
            fn()
        return 1e3 * (time.perf_counter() - t0) / replays
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        fn()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / replays


def _loop_step(rt: StaticSpeculator, prompt_len: int, mask_id: int):
    """One greedy device-loop step at a fresh state each time (the positions never run out)."""
    device = rt.block.device

    def step():
        rt.begin(torch.zeros(1, dtype=torch.long, device=device), torch.tensor([[prompt_len]], device=device),
                 torch.tensor([[SLOTS - 2 * rt.block.shape[1]]], device=device), mask_id, [])
        rt.greedy_step()
    return step


def parts(drafter, target, device, compile_target: bool = False) -> dict[str, float]:
    """ms per call of each graph: plain, verify, draft, the device-loop step. With
    ``compile_target`` the target's forward is compiled after the (eager) prefills."""
    ids = torch.randint(0, target.config.vocab_size // 2, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    plain = TargetSlots(target, SLOTS, width=1)
    plain.prefill(ids, logits_to_keep=1)
    plain.positions.fill_(PROMPT_LEN)
    rt = StaticSpeculator(drafter, target, SLOTS)
    _, feats = rt.verifier.prefill(ids, logits_to_keep=1)
    width = drafter.block_size
    rt.end.fill_(SLOTS - 1)
    rt.set_block(torch.zeros(1, dtype=torch.long, device=device), PROMPT_LEN, drafter.mask_token_id)
    rt.ctx_feats.copy_(feats[:, -width:])
    rt.ctx_pos.copy_(torch.arange(PROMPT_LEN - width, PROMPT_LEN, device=device)[None])
    if compile_target:
        target.forward = torch.compile(target.forward, dynamic=False)
    return {"plain": per_call_ms(plain.step, device), "verify": per_call_ms(rt.verify_step, device),
            "draft": per_call_ms(rt.draft_step, device),
            "loop step": per_call_ms(_loop_step(rt, PROMPT_LEN, drafter.mask_token_id), device)}


def run(argv: list[str] | None = None) -> dict:
    cfg = load_command(EvalConfig, argv, "eval", __doc__, validate)
    _, target, drafter, _, _ = setup(cfg)
    model, device = target.model, torch.device(cfg.device)
    print(f"{cfg.target.name} on {cfg.device}: ms a call, and in plain steps of the same arm", flush=True)
    print(f"{'arm':<26} " + " ".join(f"{n:>16}" for n in ("plain", "verify", "draft", "loop step")), flush=True)
    arms = {}
    # compiling is a GPU runtime option; on a CPU it would take minutes
    plan = [("eager", False, False)] + ([("compiled draft", True, False), ("compiled draft and target", True, True)]
                                         if device.type == "cuda" else [])
    for arm, compile_draft, compile_target in plan:
        drafter.compile_static_draft = compile_draft
        with torch.inference_mode():
            ms = arms[arm] = parts(drafter, model, device, compile_target)
        print(f"{arm:<26} " + " ".join(f"{v:>7.3f} ({v / ms['plain']:>4.2f})" for v in ms.values()), flush=True)
    return arms


def main(argv: list[str] | None = None) -> None:
    run_command("runtime_parts", run, argv)


if __name__ == "__main__":
    main()
