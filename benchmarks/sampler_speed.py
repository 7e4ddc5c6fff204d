"""The data generator's sampler, one decode step's draw for every slot: sampler v2 (the inverse
CDF in token order, what temperature alone now runs) against v1's sorted CDF (what `top_k` or
`top_p` still run; top_k=vocabulary cuts nothing, so it times v1's draw). Prints a table.

    python -m benchmarks.sampler_speed                       # CPU, 64 slots
    python -m benchmarks.sampler_speed --device cuda --slots 512
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.cuda_timing import timer
from data_gen.sampling import sample_tokens


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=151_936)  # Qwen2.5's
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(args.slots, args.vocab, generator=gen, device=device, dtype=torch.float32) * 3
    u = torch.rand(args.slots, generator=gen, device=device, dtype=torch.float64)
    v1, v2 = timer(device, args.repeats)(lambda: sample_tokens(logits, u, args.temperature, top_k=args.vocab),
                                         lambda: sample_tokens(logits, u, args.temperature))
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"| sampler ({args.slots} slots x {args.vocab} tokens, {where}) | ms a step |")
    print("|---|---|")
    print(f"| v2: the CDF in token order (temperature alone) | {v2:.2f} |")
    print(f"| v1: the CDF over the sorted vocabulary (top_k / top_p) | {v1:.2f} |")


if __name__ == "__main__":
    main()
