"""Next turns packed after what their rows hold (data_gen/engine_attention.py
packed_kept_attention): one layout and one per-token reference, shared by the CPU test (SDPA under
the dense mask, float32) and the GPU one (flash attention's variable-length kernel, bf16).

Two conversations hold 5 and 2 tokens and get 3 and 2 new ones, then padding (a sequence of its
own, numbered 2, at the last cache column)."""

import torch
import torch.nn.functional as F

from data_gen.engine_attention import packed_kept_attention, sequence_bounds

NEW_TOKENS = 5  # the real new tokens; the 2 after them are padding
KEYS = 15


def kept_layout(device: str = "cpu") -> tuple[torch.Tensor, ...]:
    """(q_seq, q_pos, k_seq, k_pos): each new token's conversation and position, each key's."""
    q_seq = torch.tensor([0] * 3 + [1] * 2 + [2] * 2, device=device)
    q_pos = torch.tensor([5, 6, 7, 2, 3, 49, 49], device=device)
    k_seq = torch.tensor([0] * 8 + [1] * 4 + [2] * 3, device=device)
    k_pos = torch.tensor(list(range(8)) + list(range(4)) + [49] * 3, device=device)
    return q_seq, q_pos, k_seq, k_pos


def assert_each_conversation_alone(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
                                   scale: float, atol: float, longest: int = 7) -> None:
    """packed_kept_attention of q (1, Hq, 7, D) over k, v (15, Hkv, D) in the layout above equals,
    for each real new token, SDPA over its own conversation's keys up to its position (and within
    `window`), computed alone in float32, to `atol`; `longest` the most new tokens of a sequence
    given (flash attention's max_seqlen_q: the row's 7, or its longest sequence's 3)."""
    q_seq, q_pos, k_seq, k_pos = kept_layout(str(q.device))
    bounds = sequence_bounds(q_seq, 4), sequence_bounds(k_seq, 4), longest
    out = packed_kept_attention(q, k, v, q_seq, k_seq, q_pos, k_pos, bounds, window, scale, {})
    groups = q.shape[1] // k.shape[1]
    for t in range(NEW_TOKENS):
        seen = (k_seq == q_seq[t]) & (k_pos <= q_pos[t])
        if window is not None:
            seen &= k_pos > q_pos[t] - window
        keys = k[seen].float().transpose(0, 1).repeat_interleave(groups, 0)
        vals = v[seen].float().transpose(0, 1).repeat_interleave(groups, 0)
        alone = F.scaled_dot_product_attention(q[0, :, t:t + 1].float(), keys, vals, scale=scale)
        assert torch.allclose(out[0, :, t:t + 1].float(), alone, atol=atol), t
