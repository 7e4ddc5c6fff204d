"""The DFlash loss: decayed per-slot cross-entropy through the frozen target LM head.

The head is large (vocab x hidden) and a step supervises up to num_anchors * B slots per
row, so full float32 logits would be [slots, vocab] at once (8192 x 152K x 4 bytes = 5 GB
for Qwen3). ``linear_cross_entropy`` walks the supervised slots in chunks and computes the
gradient with respect to the hidden states chunk by chunk during the forward, so at most
one chunk of logits exists at any time and nothing is recomputed in backward.

Two walks share that structure. The plain one (CPU) runs each step of the softmax as its
own op; on a GPU each of those ops is a full memory pass over a (chunk, vocab) float32
tensor while the matmuls are cheap. The fused one (CUDA by default) keeps the logits in the
head's dtype and computes loss, argmax hits and d loss / d logits in one kernel over
fixed-size chunks: on CUDA a Triton kernel that reads each row twice (``ce_kernel.py``),
elsewhere ``fused_ce_reference`` through torch.compile, which compiles once whatever the
number of supervised slots. ``fused_ce_reference`` is the reference both are held to.

Two options beside the contract's loss (both off by default, which leaves the hard-label
path exactly as it was):
  * distillation (``Distillation``): slot k of the block at anchor p also learns the
    target's own next-token distribution after position p + k - 1 (the position whose next
    token x[p + k] is the hard label). The soft targets come from the target's final hidden
    states through the same frozen head, chunk by chunk like the drafter's logits. Per slot:
        (1 - a) * CE(z, y) + a * t^2 * KL(softmax(s / t) || softmax(z / t))
    with z the drafter's logits, s the target's, y the hard label, a = ``weight``,
    t = ``temperature`` (Hinton's t^2 keeps the gradient scale independent of t). KL rather
    than cross-entropy to the soft targets: the gradient is the same (they differ by the
    targets' entropy, a constant), but KL is 0 for a perfect drafter, so the logged loss
    reads as a distance.
  * D-PACE position weights (``dpace_alpha``; arXiv 2605.18810, "Dynamic Position-Aware
    Cross-Entropy"): instead of exp(-(k-1)/gamma), slot j of a block is weighted by
        w_j = sum_{m >= j} prod_{i <= m} q~_i,   q~_i = (1 - alpha) * q_i + alpha,
    where q_i = exp(-CE_i) is the drafter's probability of the label at slot i in this very
    forward (detached). prod_{i<=m} q~_i estimates the chance the draft is accepted up to
    slot m, so w_j is the expected accepted length that slot j is a prefix of: the weight
    moves to later slots as earlier ones become reliable. Unsupervised slots count as
    q~ = 1 in the products and add nothing to the sums.

A DFlash2 drafter's selector rescores each supervised slot's top-K tokens under the same head:
``dflash_loss(top_k=K)`` keeps them (``Candidates``) from the logits its walk computes anyway,
with the weight each slot's CE got (D-PACE's too), and ``selector_term`` adds the selector's
K-way CE under those weights without running the head again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dflash_train.contract import ANCHOR_SLOT, IGNORE_INDEX, accepted_prefix
from dflash_train.training import ce_kernel, topk_kernel

# One chunk: (logits (c, V), teacher logits (c, V) or None, labels (c,), slot_w (c,) float32, with_grad)
# -> (w * loss per row (c,), hard CE per row (c,), argmax hits (c,), w * dloss/dlogits or None)
ChunkKernel = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, bool],
                       tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]]


def fused_ce_reference(
    logits: torch.Tensor, teacher: torch.Tensor | None, labels: torch.Tensor, slot_w: torch.Tensor, with_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk of weighted CE from logits (c, V), labels (c,), slot weights (c,) float32.

    Written as plain torch so that inductor fuses it: float32 exists only in registers, the
    logits are read by one reduction and one pointwise kernel, and the gradient is written
    once, in the logits' dtype, ready for the matmul back to the hidden states. ``teacher``
    is unused (the signature is the one every chunk kernel has).
    """
    x = logits.float()  # (c, V)
    top, argmax = x.max(dim=-1)  # (c,)
    exp = (x - top[:, None]).exp()  # (c, V)
    norm = exp.sum(dim=-1)  # (c,)
    target = x.gather(1, labels[:, None]).squeeze(1)  # (c,)
    ce = top + norm.log() - target  # (c,)
    hit = argmax == labels
    if not with_grad:
        return ce * slot_w, ce, hit, None
    # d CE / d logits = softmax - onehot, scaled by the slot weight. A where over an iota
    # comparison is pointwise, so it fuses; an index_put would be a separate kernel.
    onehot = torch.arange(x.shape[1], device=x.device) == labels[:, None]  # (c, V)
    probs = exp / norm[:, None]
    grad = torch.where(onehot, probs - 1, probs) * slot_w[:, None]
    return ce * slot_w, ce, hit, grad.to(logits.dtype)


def _soft_ce(logits: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor, slot_w: torch.Tensor,
             with_grad: bool, distill_weight: float,
             temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk of (1 - a) * CE + a * t^2 * KL(target || drafter), a = ``distill_weight``.

    The kernel of both walks when distilling: run eagerly on the plain walk's float32
    logits, compiled on the fused walk's (head-dtype) ones. Shapes as ``fused_ce_reference``;
    ``teacher`` (c, V) are the target's logits at the positions the slots' labels follow.
    d/dz = (1 - a) * (softmax(z) - onehot) + a * t * (softmax(z / t) - softmax(s / t)).
    """
    a, t = distill_weight, temperature
    z = logits.float()  # (c, V)
    top, argmax = z.max(dim=-1)  # (c,)
    exp = (z - top[:, None]).exp()  # (c, V)
    norm = exp.sum(dim=-1)  # (c,)
    ce = top + norm.log() - z.gather(1, labels[:, None]).squeeze(1)  # (c,)
    if t == 1.0:
        zt, zt_exp, zt_lse = z, exp, top + norm.log()
    else:  # the max of z / t is top / t for t > 0
        zt = z / t
        zt_exp = (zt - (top / t)[:, None]).exp()
        zt_lse = top / t + zt_exp.sum(dim=-1).log()
    st = teacher.float() / t  # (c, V)
    st_top = st.amax(dim=-1)
    st_exp = (st - st_top[:, None]).exp()
    st_norm = st_exp.sum(dim=-1)
    p_target = st_exp / st_norm[:, None]  # (c, V) the soft targets
    # KL(p || q) = sum p (log p - log q) = sum p (st - zt) - lse(st) + lse(zt), as sum p = 1.
    kl = (p_target * (st - zt)).sum(dim=-1) - (st_top + st_norm.log()) + zt_lse  # (c,)
    loss = (1 - a) * ce + (a * t * t) * kl
    hit = argmax == labels
    if not with_grad:
        return loss * slot_w, ce, hit, None
    onehot = torch.arange(z.shape[1], device=z.device) == labels[:, None]  # (c, V)
    probs = exp / norm[:, None]
    q_t = probs if t == 1.0 else zt_exp / zt_exp.sum(dim=-1, keepdim=True)
    grad = (1 - a) * torch.where(onehot, probs - 1, probs) + (a * t) * (q_t - p_target)
    return loss * slot_w, ce, hit, (grad * slot_w[:, None]).to(logits.dtype)


@functools.cache
def compiled_kernel(kernel: Callable, dynamic: bool | None = False) -> Callable:
    # Built on first use, not at import: importing dynamo costs seconds. Chunks have one fixed
    # shape, so each (chunk, vocab, dtype, with_grad) compiles once; dynamic=False keeps dynamo
    # from generalising to symbolic shapes after a second shape (None lets it, for a kernel
    # with an input whose size varies, such as DSpark's teacher table). The distillation weight
    # and temperature are Python floats: constants of the graph, fixed for a run.
    return torch.compile(kernel, dynamic=dynamic, fullgraph=True)


@dataclass
class _Walk:
    """What one pass over the supervised slots needs besides hidden, head and labels."""

    chunk_size: int
    kernel: ChunkKernel | None  # None: the plain walk's own hard-label code
    fused: bool  # fixed-size chunks in the head's dtype
    teacher: torch.Tensor | None  # (M, H): the target's final hidden state per slot, to distil from
    keep_rows: bool  # also return per-row losses and CE (D-PACE reweights them afterwards)
    top_k: int = 0  # also keep each row's top-k logits and their tokens (a DFlash2 selector's candidates)


def _candidate_rows(m: int, walk: _Walk, device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Empty (M, k) tokens and float32 logits for ``_keep_top``, or None when k is 0."""
    if not walk.top_k:
        return None
    return (torch.empty(m, walk.top_k, dtype=torch.long, device=device),
            torch.empty(m, walk.top_k, dtype=torch.float32, device=device))


# Columns per segment of ``top_k_rows``: a row's top k lie in the k segments of highest maximum.
# The CUDA chunk kernel writes these maxima in its first pass (ce_kernel.SEGMENT).
TOP_K_SEGMENT = ce_kernel.SEGMENT


def segmented(vocab: int, k: int) -> bool:
    """Whether ``top_k_rows`` of rows of ``vocab`` columns goes through segment maxima."""
    return vocab // TOP_K_SEGMENT > 2 * k  # else too few segments to gain anything


def top_k_rows(logits: torch.Tensor, k: int, segment_max: torch.Tensor | None = None,
               values: torch.Tensor | None = None, columns: torch.Tensor | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits.topk(k, dim=-1)`` of logits (n, V): values and columns (n, k), highest first,
    the same values (ties between equal logits may pick other columns, as topk's own order is
    unspecified there).

    A full-width top-k reads each row several times (a radix select pass per digit). Here one
    pass takes each segment's maximum, and the top k are then chosen among k segments of
    ``TOP_K_SEGMENT`` columns: the k segments of highest maximum hold k distinct values at least
    as high as any column outside them, so the row's top k values lie in them (and in the
    columns past the last whole segment, always kept). ``segment_max`` (n, V // TOP_K_SEGMENT),
    when ``segmented``: those maxima, computed already (the CUDA chunk kernel's), so that pass
    is skipped. On CUDA with Triton the rest is one kernel (``topk_kernel``); the torch code
    below is its reference and the fallback. ``values`` (n, k) (the logits' dtype or float32)
    and ``columns`` (n, k) long, when given, receive the result (the kernel writes them in place)
    and are returned.
    """
    if segmented(logits.shape[1], k) and topk_kernel.available(logits.device):
        return topk_kernel.top_k(logits, k, segment_max, values=values, columns=columns)
    top, cols = top_k_by_segments(logits, k, segment_max) if segmented(logits.shape[1], k) else logits.topk(k, dim=-1)
    if values is None:
        return top, cols
    values.copy_(top)
    columns.copy_(cols)
    return values, columns


def top_k_by_segments(logits: torch.Tensor, k: int,
                      segment_max: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``top_k_rows`` in torch, for ``segmented`` rows: a topk of the segment maxima, a gather of
    the k best segments' columns and a topk of those. ``topk_kernel`` is held to it and to topk."""
    n, vocab = logits.shape
    whole = vocab // TOP_K_SEGMENT
    if segment_max is None:
        segment_max = topk_kernel.segment_maxima(logits)  # (n, whole)
    best = segment_max.topk(k, dim=-1).indices  # (n, k) segments
    offsets = torch.arange(TOP_K_SEGMENT, device=logits.device)
    cols = (best[:, :, None] * TOP_K_SEGMENT + offsets).flatten(1)  # (n, k * segment)
    if whole * TOP_K_SEGMENT < vocab:
        tail = torch.arange(whole * TOP_K_SEGMENT, vocab, device=logits.device)
        cols = torch.cat([cols, tail.expand(n, -1)], dim=1)
    values, picked = logits.gather(1, cols).topk(k, dim=-1)  # (n, k)
    return values, cols.gather(1, picked)


def _keep_top(cand, sl: slice, logits: torch.Tensor, segment_max: torch.Tensor | None = None) -> None:
    """Rows ``sl`` of ``cand``: the top-k of ``logits`` (n, V) (``top_k_rows``, with its segment
    maxima when computed already). The selector's candidates are these logits' own top-k, so
    nothing runs the head a second time."""
    if cand is not None:  # written into the table's rows (float32 values)
        top_k_rows(logits, cand[0].shape[1], segment_max, values=cand[1][sl], columns=cand[0][sl])


class _Scratch:
    """Reusable (rows, vocab) buffers for the plain walk on a CPU, one per (role, dtype): a
    chunk's logits in the head's dtype (later its gradient, once the logits are float32) and,
    for a bf16 head, their float32 copy.

    A chunk's logits are tens of megabytes (189 x 49,152 in float32 is 37 MB): glibc maps
    blocks that large afresh on every allocation and unmaps them on free, so each new tensor
    first takes a page fault per 4 KB written. On 2 cores converting the bf16 logits to a new
    float32 tensor took 12 ms against 1.7 ms into a warm buffer; the two such conversions of
    a quickstart step were 16 of its 207 ms. Kept for the process; grown, never shrunk.
    """

    def __init__(self):
        self.buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get(self, role: str, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self.buffers.get((role, dtype))
        if buf is None or buf.shape[0] < rows or buf.shape[1] != cols:
            buf = self.buffers[(role, dtype)] = torch.empty(rows, cols, dtype=dtype)
        return buf[:rows]  # the first rows of a row-major buffer: contiguous


_CPU_SCRATCH = _Scratch()


def _head_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """float32 (c, V) logits of ``h`` (c, H) through the head in its own dtype; on a CPU
    written into reused buffers (``_Scratch``): the values of ``F.linear(...).float()``."""
    if h.device.type != "cpu":
        return F.linear(h, weight, bias).float()
    rows, vocab = h.shape[0], weight.shape[0]
    out = _CPU_SCRATCH.get("head", rows, vocab, weight.dtype)
    if bias is None:
        torch.mm(h, weight.t(), out=out)
    else:
        torch.addmm(bias, h, weight.t(), out=out)
    if weight.dtype == torch.float32:
        return out
    return _CPU_SCRATCH.get("float32", rows, vocab, torch.float32).copy_(out)


def _in_head_dtype(probs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``probs.to(dtype)``; on a CPU into the head-dtype buffer (``_Scratch``), whose logits
    were copied to float32 before ``probs`` was computed from them."""
    if probs.dtype == dtype or probs.device.type != "cpu":
        return probs.to(dtype)
    return _CPU_SCRATCH.get("head", probs.shape[0], probs.shape[1], dtype).copy_(probs)


def _plain_chunks(hidden, weight, bias, labels, slot_w, walk: _Walk, with_grad):
    m = hidden.shape[0]
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    correct = torch.zeros(labels.shape, dtype=torch.bool, device=hidden.device)
    grad = torch.empty_like(hidden) if with_grad else None
    rows = torch.empty(2, m, dtype=torch.float32, device=hidden.device) if walk.keep_rows else None  # loss, CE
    cand = _candidate_rows(m, walk, hidden.device)
    for start in range(0, m, walk.chunk_size):
        sl = slice(start, start + walk.chunk_size)
        if walk.kernel is not None:  # distillation: the shared soft kernel, eagerly
            logits = F.linear(hidden[sl], weight, bias).float()  # (c, V)
            _keep_top(cand, sl, logits)
            teacher = F.linear(walk.teacher[sl], weight, bias).float()  # (c, V)
            loss, ce, hit, grad_logits = walk.kernel(logits, teacher, labels[sl], slot_w[sl], grad is not None)
            total += loss.sum()
            correct[sl] = hit
            if grad is not None:
                grad[sl] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
            if rows is not None:
                rows[0, sl], rows[1, sl] = loss, ce
            continue
        logits = _head_logits(hidden[sl], weight, bias)  # (c, V) float32: the only big tensor
        _keep_top(cand, sl, logits)  # before the in-place softmax below overwrites the logits
        target = logits.gather(1, labels[sl, None]).squeeze(1)  # (c,)
        # logsumexp by hand: the exponentials are kept for the gradient, and on CPU this is
        # twice as fast as torch.logsumexp followed by a second exp pass.
        top, argmax = logits.max(dim=-1)  # (c,)
        probs = logits.sub_(top[:, None]).exp_()  # unnormalised, in place of the logits
        norm = probs.sum(dim=-1)  # (c,)
        ce = top + norm.log() - target  # (c,)
        total += (ce * slot_w[sl]).sum()
        correct[sl] = argmax == labels[sl]
        if rows is not None:
            rows[0, sl], rows[1, sl] = ce * slot_w[sl], ce
        if grad is not None:
            # d CE / d logits = softmax - onehot, scaled by the slot weight.
            probs /= norm[:, None]
            probs[torch.arange(probs.shape[0], device=probs.device), labels[sl]] -= 1
            probs *= slot_w[sl, None]
            grad[sl] = (_in_head_dtype(probs, weight.dtype) @ weight).to(hidden.dtype)
    return total, correct, grad, rows, cand


def _fused_chunks(hidden, weight, bias, labels, slot_w, walk: _Walk, with_grad):
    m, c = hidden.shape[0], walk.chunk_size
    # The last chunk is padded to the fixed size with zero hidden rows, label 0 and weight 0:
    # their loss is finite (logits = bias) and multiplied by 0, so they add exactly nothing;
    # their hits, rows and gradient rows are cut off below.
    pad = -m % c
    labels, slot_w = F.pad(labels, (0, pad)), F.pad(slot_w, (0, pad))  # (M + pad,)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    correct = torch.empty(m, dtype=torch.bool, device=hidden.device)
    grad = torch.empty_like(hidden) if with_grad else None
    rows = torch.empty(2, m, dtype=torch.float32, device=hidden.device) if walk.keep_rows else None  # loss, CE
    cand = _candidate_rows(m, walk, hidden.device)

    def fixed(x, sl, n):  # (n, H) -> (c, H) zero-padded
        return x[sl] if n == c else F.pad(x[sl], (0, 0, 0, c - n))

    # The Triton kernel writes the segment maxima of the candidates' top-k in its first pass;
    # the other kernels leave them to top_k_rows. No kernel here writes into the logits.
    vocab = weight.shape[0]
    seg = None
    if cand is not None and walk.kernel is ce_kernel.fused_ce and segmented(vocab, walk.top_k):
        seg = torch.empty(c, vocab // TOP_K_SEGMENT, dtype=weight.dtype, device=hidden.device)  # (c, V / segment)
    extra = {} if seg is None else {"segment_max": seg}
    for start in range(0, m, c):
        sl = slice(start, start + c)
        n = min(c, m - start)
        logits = F.linear(fixed(hidden, sl, n), weight, bias)  # (c, V) in the head's dtype, never upcast in memory
        teacher = None if walk.teacher is None else F.linear(fixed(walk.teacher, sl, n), weight, bias)  # (c, V)
        loss, ce, hit, grad_logits = walk.kernel(logits, teacher, labels[sl], slot_w[sl], grad is not None, **extra)
        _keep_top(cand, sl, logits[:n], None if seg is None else seg[:n])
        total += loss.sum()
        correct[sl] = hit[:n]
        if rows is not None:
            rows[0, sl], rows[1, sl] = loss[:n], ce[:n]
        if grad is not None:
            grad[sl] = (grad_logits @ weight)[:n].to(hidden.dtype)  # (n, H)
    return total, correct, grad, rows, cand


class _LinearCrossEntropy(torch.autograd.Function):
    """sum_i w_i * loss(hidden_i @ W^T + b, label_i), with grad only for ``hidden``; also the
    argmax hits and, when ``walk.top_k``, each row's top-k tokens and float32 logits and its
    weight w_i (else None).

    ``reweight`` None: w = ``slot_w``. Otherwise the walk runs with ``slot_w`` (all ones)
    and ``reweight(ce_rows)`` gives the weights afterwards (D-PACE needs every slot's CE of a
    block first); loss and gradient are linear in w, so scaling rows afterwards is exact.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, slot_w, walk, reweight):
        # hidden (M, H), weight (V, H), labels (M,), slot_w (M,) float32
        walker = _fused_chunks if walk.fused else _plain_chunks
        total, correct, grad, rows, cand = walker(hidden, weight, bias, labels, slot_w, walk, ctx.needs_input_grad[0])
        w = slot_w
        if reweight is not None:
            w = reweight(rows[1])  # (M,)
            total = (rows[0] * w).sum()
            if grad is not None:
                grad *= w[:, None].to(grad.dtype)
        ctx.save_for_backward(grad)
        tokens, logits = cand or (None, None)
        row_w = w if cand is not None else None  # the weights a DFlash2 selector term shares
        ctx.mark_non_differentiable(correct, *(cand or ()), *(() if row_w is None else (row_w,)))
        return total, correct, tokens, logits, row_w

    @staticmethod
    def backward(ctx, grad_total, _grad_correct, _grad_tokens, _grad_logits, _grad_row_w):
        (grad,) = ctx.saved_tensors
        return grad * grad_total.to(grad.dtype), None, None, None, None, None, None


def dpace_weights(ce: torch.Tensor, block: torch.Tensor, slot: torch.Tensor, num_blocks: int, block_size: int,
                  alpha: float) -> torch.Tensor:
    """(M,) D-PACE weights of supervised slots from their CE (M,) (see the module docstring).

    ``block`` (M,) and ``slot`` (M,) place each row in a dense (num_blocks, B) grid; slots
    that are not supervised hold q~ = 1 and no credit. Detached, and without host syncs.
    """
    q = (1 - alpha) * torch.exp(-ce.detach().float()) + alpha  # (M,) smoothed confidences
    grid = torch.ones(num_blocks, block_size, dtype=torch.float32, device=ce.device)
    grid.index_put_((block, slot), q)
    valid = torch.zeros_like(grid).index_put_((block, slot), torch.ones_like(q))
    reach = grid.cumprod(dim=1) * valid  # (num_blocks, B): P(accepted up to slot m), supervised m only
    suffix = reach.flip(1).cumsum(dim=1).flip(1)  # w_j = sum_{m >= j} reach_m
    return suffix[block, slot]


def supervised_blocks(labels: torch.Tensor, block_size: int) -> torch.Tensor:
    """() float32: blocks with at least one supervised slot, D-PACE's loss normaliser.

    D-PACE's weights are expected accepted lengths; dividing by their own sum would cancel
    that scale (the D-PACE author's advice), so the loss is averaged over blocks instead.
    """
    return (labels.reshape(-1, block_size) != IGNORE_INDEX).any(dim=1).float().sum()


def accepted_drafts(index: torch.Tensor, hit: torch.Tensor, queries: int, block_size: int,
                    first_slot: int) -> torch.Tensor:
    """() float32: the drafts greedy verification accepts, summed over all blocks, from the
    hits ``hit`` (M,) bool of the supervised slots ``index`` (M,) (flat indices into the
    ``queries`` = b * N * B slots, whole blocks of B back to back).

    A block drafts slots ``first_slot``..B-1 (DFlash: 1.., the anchor slot predicts nothing;
    DSpark: 0..) and accepts them up to its first miss or unsupervised slot
    (``contract.accepted_prefix``). Under teacher forcing that is the runtime's own count
    for every kind: while the drafts before a slot were accepted they equal the gold tokens
    a Markov head or a selector was fed. Integer ops on the device, no host sync.
    """
    hits = torch.zeros(queries, dtype=torch.bool, device=hit.device).scatter_(0, index, hit)  # (b * N * B,)
    return accepted_prefix(hits.view(-1, block_size)[:, first_slot:]).sum().float()


@dataclass
class Distillation:
    """The target's own next-token distributions as soft targets (see the module docstring)."""

    hidden: torch.Tensor  # (b, T, H): the target's final hidden states, after its final norm
    anchors: torch.Tensor  # (b, N) long: each block's anchor position in its row
    weight: float  # a in [0, 1]: 0 hard labels only, 1 soft targets only
    temperature: float = 1.0


def soft_target_index(index: torch.Tensor, anchors: torch.Tensor, block_size: int, seq_len: int) -> torch.Tensor:
    """(M,) flat indices into the target's (b * T) positions of the supervised slots' soft targets.

    Slot k of the block at anchor p is labelled x[p + k]; the target's prediction of that
    token is its distribution after position p + k - 1. ``index`` (M,) are flat indices into
    (b * Q) with Q = N * B, so index // B is the block's flat number and index % B its slot.
    """
    block = index // block_size
    slot = index % block_size
    row = index // (anchors.shape[1] * block_size)
    return row * seq_len + anchors.flatten().index_select(0, block) + slot - 1


@dataclass
class Candidates:
    """Each supervised slot's top-k tokens under the head and their logits, rows in the order
    of the loss's supervised index: what a DFlash2 selector rescores (``dflash_loss(top_k=k)``)."""

    tokens: torch.Tensor  # (M, k) long, the highest logit first
    logits: torch.Tensor  # (M, k) float32, detached: the head's logits at ``tokens``
    # (M,) float32, detached: the weight the loss gave each row (the slot weights, or the
    # D-PACE weights from this forward's CE), which the selector term shares
    weights: torch.Tensor


class _CandidateLogits(torch.autograd.Function):
    """The head's logits at ``tokens``, computed already (``Candidates.logits``), as a function
    of ``hidden``: d/dh sum_k g_k <h, W[c_k]> = sum_k g_k W[c_k], summed by embedding_bag
    without gathering the (M, k, H) rows. No gradient for the frozen head (as the CE's)."""

    @staticmethod
    def forward(ctx, hidden, weight, tokens, logits):
        # hidden (M, H) in the head's dtype, weight (V, H), tokens (M, k), logits (M, k) float32
        ctx.save_for_backward(weight, tokens)
        return logits.clone()

    @staticmethod
    def backward(ctx, grad):
        weight, tokens = ctx.saved_tensors
        bag = F.embedding_bag(tokens, weight, per_sample_weights=grad.to(weight.dtype), mode="sum")  # (M, H)
        return bag, None, None, None


def selector_term(drafter: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, input_ids: torch.Tensor,
                  anchors: torch.Tensor, lm_head: nn.Module, candidates: Candidates,
                  index: torch.Tensor | None = None,
                  stop_gradient: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A DFlash2 drafter's selector loss over the supervised slots: (() float32, summed like
    ``dflash_loss``'s numerator; (B,) float32, the selector's hits per slot; () float32, the
    drafts its walk gets accepted, ``accepted_drafts`` of those hits: what a DFlash2 drafter
    proposes is the walk's pick, not the unary argmax).

    Each supervised slot k of the block at anchor p is scored with its teacher-forced
    predecessor x[p + k - 1] (the anchor for slot 1), read from ``input_ids`` (b, T) at the
    position ``soft_target_index`` names; its candidates and its weight are ``dflash_loss``'s
    for the same slots (``candidates``, from the same ``index``): the selector's CE is weighted
    as the unary CE is, D-PACE included (SpecForge and NeMo AutoModel do the same; see
    model/dflash2.py). The rest is ``DFlash2DraftModel.selector_loss``. A hit is a slot whose
    selector pick, after its gold predecessor, is the gold token: what the drafting walk
    proposes there whenever the slots before it were accepted.

    ``stop_gradient`` (drafter.dflash2.selector_stop_gradient, SpecForge's option): the same
    value, but its gradient reaches only the selector's own parameters: h is detached and the
    unary logits are the loss's detached ones, so nothing flows into the backbone.
    """
    block_size = drafter.block_size
    if index is None:
        index = (labels.flatten() != IGNORE_INDEX).nonzero().squeeze(1)  # (M,)
    index = index.to(labels.device, non_blocking=True)
    pred = input_ids.flatten().index_select(0, soft_target_index(index, anchors, block_size, input_ids.shape[1]))
    h = hidden.flatten(0, 1).index_select(0, index)  # (M, H)
    gold = labels.flatten().index_select(0, index)  # (M,)
    if stop_gradient:
        h, unary = h.detach(), candidates.logits  # (M, H), (M, k) float32, both without a graph
    else:
        unary = _CandidateLogits.apply(h.to(lm_head.weight.dtype), lm_head.weight, candidates.tokens,
                                       candidates.logits)  # (M, k)
    total, hits = drafter.selector_loss(h, pred, gold, candidates.tokens, unary, candidates.weights)
    slot = index % labels.shape[1] % block_size  # (M,)
    correct = torch.zeros(block_size, dtype=torch.float32, device=hidden.device).scatter_add(0, slot, hits.float())
    return total, correct, accepted_drafts(index, hits, labels.numel(), block_size, ANCHOR_SLOT + 1)


@dataclass
class LossOutput:
    weighted_sum: torch.Tensor  # () float32, differentiable: sum of w_k * loss over valid slots
    # () float32: this micro-batch's share of the loss normaliser: the sum of w_k over valid
    # slots (static weights) or the number of blocks with a supervised slot (D-PACE)
    weight_sum: torch.Tensor
    correct: torch.Tensor  # (B,) float32: argmax hits per slot
    count: torch.Tensor  # (B,) float32: supervised slots per slot index
    # () float32: blocks with a supervised slot, and the drafts greedy verification accepts
    # in them in all (``accepted_drafts``): the exact tau is 1 + accepted / blocks
    blocks: torch.Tensor
    accepted: torch.Tensor
    candidates: Candidates | None = None  # with ``top_k``: each supervised slot's top-k under the head
    # (B,) float32: the unary argmax's hits per slot where ``correct`` counts other drafts
    # (a DFlash2 drafter's selector walk; set by the trainer), else None
    unary_correct: torch.Tensor | None = None


def dflash_loss(hidden: torch.Tensor, labels: torch.Tensor, lm_head: nn.Module, weights: torch.Tensor,
                chunk_size: int, *, index: torch.Tensor | None = None, fused: bool | None = None,
                compiled: bool = True, distill: Distillation | None = None,
                dpace_alpha: float | None = None, top_k: int = 0) -> LossOutput:
    """Weighted loss of drafter outputs ``hidden`` (b, Q, H) against ``labels`` (b, Q).

    ``weights`` (B,) are the per-slot weights; slot k of a block is query q with q % B == k.
    The caller divides ``weighted_sum`` by the (global) loss normaliser (``weight_sum``
    summed over micro-batches and ranks).

    ``index`` (M,) long: flat indices into ``hidden.flatten(0, 1)`` of the supervised slots
    (label != IGNORE_INDEX), each once, computed by the caller on the host; in ascending order the sums match the
    masked ones bit for bit. Without it they are found from ``labels``, which makes a GPU
    wait for the count; with it nothing here waits for the device.
    ``fused`` picks the fused walk (default: on CUDA); ``compiled`` False runs its kernel
    eagerly (tests, debugging). ``distill`` mixes in the target's soft targets (None or
    weight 0: hard labels only, the contract's loss unchanged); ``dpace_alpha`` replaces
    ``weights`` by D-PACE weights with that smoothing. ``top_k`` > 0 also returns each
    supervised slot's top-k tokens and logits (``Candidates``), read from the same logits.
    """
    block_size, queries = weights.numel(), labels.shape[1]
    if index is None:
        index = (labels.flatten() != IGNORE_INDEX).nonzero().squeeze(1)  # (M,)
    # non_blocking: a host tensor's copy must not make the host wait for the GPU's queue.
    index = index.to(labels.device, non_blocking=True)
    slot = index % queries % block_size  # (M,)
    # The head runs in its own dtype (bf16 for a GPU target), whatever the drafter computed in.
    h = hidden.flatten(0, 1).index_select(0, index).to(lm_head.weight.dtype)  # (M, H)
    y = labels.flatten().index_select(0, index)  # (M,)
    w = weights.to(hidden.device, torch.float32, non_blocking=True).index_select(0, slot)  # (M,)
    if fused is None:
        fused = hidden.is_cuda
    teacher, kernel = None, None
    if distill is not None and distill.weight > 0:
        t_index = soft_target_index(index, distill.anchors.to(labels.device), block_size, distill.hidden.shape[1])
        teacher = distill.hidden.flatten(0, 1).index_select(0, t_index).to(lm_head.weight.dtype)  # (M, H)
        soft = compiled_kernel(_soft_ce) if fused and compiled else _soft_ce
        kernel = functools.partial(soft, distill_weight=distill.weight, temperature=distill.temperature)
    elif fused and not compiled:
        kernel = fused_ce_reference
    elif fused:
        kernel = ce_kernel.fused_ce if ce_kernel.available(hidden.device) else compiled_kernel(fused_ce_reference)
    reweight = None
    if dpace_alpha is not None:
        w = torch.ones_like(w)
        reweight = functools.partial(dpace_weights, block=index // block_size, slot=slot,
                                     num_blocks=labels.numel() // block_size, block_size=block_size, alpha=dpace_alpha)
    walk = _Walk(chunk_size, kernel, fused, teacher, keep_rows=reweight is not None, top_k=top_k)
    total, hit, tokens, logits, row_w = _LinearCrossEntropy.apply(h, lm_head.weight, getattr(lm_head, "bias", None),
                                                                  y, w, walk, reweight)
    # scatter_add, not bincount: bincount reads its maximum back to the host on CUDA.
    zeros = torch.zeros(block_size, dtype=torch.float32, device=hidden.device)
    count = zeros.scatter_add(0, slot, torch.ones_like(w))
    correct = zeros.scatter_add(0, slot, hit.float())
    blocks = supervised_blocks(labels, block_size)
    accepted = accepted_drafts(index, hit, labels.numel(), block_size, ANCHOR_SLOT + 1)
    norm = w.sum() if reweight is None else blocks
    candidates = None if tokens is None else Candidates(tokens, logits, row_w)
    return LossOutput(weighted_sum=total, weight_sum=norm, correct=correct, count=count, blocks=blocks,
                      accepted=accepted, candidates=candidates)
