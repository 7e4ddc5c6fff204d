"""FLOP estimates for one training step and the device's measured bf16 matmul rate (for MFU).

Counts are the usual 2 * (multiply-adds) of the matmuls; training a layer costs its forward
three times (forward, grad wrt inputs, grad wrt weights). Norms, RoPE and softmax are left
out: they are bandwidth-bound and small next to the matmuls.
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass

import torch


@dataclass
class StepShape:
    """What one micro-batch row costs: T context tokens, Q = N*B queries, M supervised slots."""

    context_tokens: int
    query_tokens: int
    supervised_slots: int
    mean_anchor: float  # average anchor position: a block query sees about this many context keys


def _linear_params(module: torch.nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))


def target_forward_flops(target_config, num_layers_run: int, tokens: int, seq_len: int) -> float:
    """Forward through the first ``num_layers_run`` decoder layers (causal attention)."""
    h, inter = target_config.hidden_size, target_config.intermediate_size
    heads = target_config.num_attention_heads
    kv = getattr(target_config, "num_key_value_heads", None) or heads
    d = getattr(target_config, "head_dim", None) or h // heads
    per_token = 2 * (h * heads * d * 2 + h * kv * d * 2 + 3 * h * inter)  # q, o, k, v, mlp
    attention = 2 * seq_len * heads * d  # causal: on average half of 2 * 2 * T * h * d per token
    return float(num_layers_run * tokens * (per_token + attention))


def drafter_train_flops(drafter: torch.nn.Module, shape: StepShape) -> float:
    """Forward + backward of the drafter on one row: fc and K/V over the context, the rest over queries."""
    cfg = drafter.config
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or h // heads
    kv = cfg.num_key_value_heads
    fc = _linear_params(drafter.fc) * shape.context_tokens
    layer_q = 2 * h * heads * d + 3 * h * cfg.intermediate_size  # q, o, mlp
    layer_kv = 2 * h * kv * d
    per_layer = layer_q * shape.query_tokens + layer_kv * (shape.context_tokens + shape.query_tokens)
    attention = 2 * shape.query_tokens * (shape.mean_anchor + drafter.block_size) * heads * d
    return 3.0 * 2 * (fc + cfg.num_hidden_layers * (per_layer + attention))


def loss_flops(hidden_size: int, vocab: int, slots: int, distill: bool = False) -> float:
    """Logits and the gradient wrt the hidden states through the frozen head (no weight grad);
    distilling adds the target's logits at the same slots (one more forward matmul)."""
    return (3.0 if distill else 2.0) * 2 * slots * vocab * hidden_size


def measure_matmul_flops(device: torch.device, size: int = 8192, iters: int = 20) -> float | None:
    """Achieved bf16 matmul FLOP/s on a CUDA device (the MFU denominator); None elsewhere.

    A measured rate rather than a datasheet number: it is what this GPU, clock and
    software stack can do, so MFU reads as "fraction of reachable matmul throughput".
    """
    if device.type != "cuda":
        return None
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize(device)
    return 2.0 * size**3 * iters / (time.perf_counter() - start)


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated GPU memory, or this process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**30 if sys.platform == "darwin" else rss / 2**20  # bytes on macOS, KiB on Linux
