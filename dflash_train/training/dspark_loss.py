"""DSpark's loss (``drafter.kind=dspark``), DeepSpec's ``compute_dspark_loss`` in our terms.

For slot k (0-based) of the block at anchor p, with label y = x[p + k + 1], the gold
previous token prev = x[p + k] (teacher forcing), the drafter's output h, the target's final
hidden state s at position p + k (the target's distribution for x[p + k + 1]) and the frozen
LM head U:
    z = U h + W2 W1[prev]                  the Markov-corrected draft logits
    CE = -log softmax(z)[y]
    L1 = sum_v |softmax(z)_v - softmax(U s)_v|        (the full L1, 2 x total variation)
    BCE = BCE_with_logits(conf(h, W1[prev]), clamp(1 - L1 / 2, 0, 1) detached)
    loss = sum_slots w (a CE + b L1 + c BCE) / sum_slots w,  w = exp(-k / gamma)
with (a, b, c) = loss.dspark_{ce,l1,confidence}_alpha (DeepSpec: 0.1, 0.9, 1.0). The
denominator is the trainer's global loss normaliser, as for DFlash.

The two vocabulary-wide terms are computed the way the DFlash loss is (training/loss.py):
the supervised slots are walked in chunks of ``chunk_size``, and one function per chunk
gives the terms AND their gradient with respect to z in closed form, with q = softmax(z)
and p = softmax(U s) (a constant):
    d(a CE + b L1)/dz = a (q - onehot(y)) + b q (sign(q - p) - sum_v sign(q_v - p_v) q_v)
times the slot's weight. The gradient goes on to h through U and to W1[prev] and W2 through
the Markov term before the chunk's logits are dropped: no autograd graph spans the
vocabulary, nothing is recomputed in backward, and one chunk of (c, V) tensors exists at a
time. On CUDA the chunks have one fixed size (the last one padded) and the function is a Triton
kernel (training/dspark_kernel.py: three passes over each row of z, two over its teacher row),
or without Triton ``dspark_chunk_terms`` compiled; elsewhere that function runs eagerly. It is
the reference the kernel is held to.
The BCE term is ordinary autograd: its target is detached, so only the confidence head's
inputs get its gradient.

Two things keep the vocabulary-wide work down (the same values; the first formulation is kept
in benchmarks/dspark_loss_first.py):
  * z is one matmul, [h ; W1[prev]] times [U ; W2] (the head and W2 side by side, V x
    (H + r)), and its gradient one matmul back, instead of a head matmul and a Markov matmul
    each way whose (c, V) results are added. The plain walk with a bf16 head (a CPU) keeps
    them apart: there the Markov term runs in its float32 weights, as bf16 matmuls are the
    slow ones on CPUs without bf16 units.
  * The target's softmax is computed once per position, not once per slot: U s for all b * T
    positions (``teacher_logits``: a (b * T, V) table in the head's dtype and its log-sum-exp),
    and each slot reads its row of the table. In the one-H100 recipe's packed rows a position
    teaches about 10 slots (1,920 blocks of 16 over 3,072 positions); the table is 1.9 GB there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash_train.contract import ANCHOR_SLOT, IGNORE_INDEX
from dflash_train.training import ce_kernel, dspark_kernel
from dflash_train.training.loss import LossOutput, accepted_drafts, compiled_kernel, supervised_blocks


@dataclass
class DSparkLossWeights:
    ce: float = 0.1
    l1: float = 0.9
    confidence: float = 1.0


def previous_tokens(labels: torch.Tensor, block_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """(b, Q) the gold token before each slot's label: the anchor for slot 0, else the label
    of the slot before. Real tokens wherever a slot is supervised (labels are cut at the first
    unsupervised slot of a block, contract.dspark_block_labels)."""
    prev = labels.roll(1, dims=1)
    first = (torch.arange(labels.shape[1], device=labels.device) % block_size) == ANCHOR_SLOT
    return torch.where(first[None], block_ids, prev)


def teacher_index(index: torch.Tensor, anchors: torch.Tensor, block_size: int, seq_len: int) -> torch.Tensor:
    """(M,) flat indices into the target's (b * T) positions: slot k of the block at anchor p
    is taught by the target's distribution after position p + k, the one predicting its label."""
    block = index // block_size
    row = index // (anchors.shape[1] * block_size)
    return row * seq_len + anchors.flatten().index_select(0, block) + index % block_size


def dspark_chunk_terms(logits: torch.Tensor, markov: torch.Tensor | None, teacher: torch.Tensor,
                       teacher_rows: torch.Tensor, teacher_lse: torch.Tensor, labels: torch.Tensor,
                       slot_w: torch.Tensor, ce_alpha: float, l1_alpha: float, with_grad: bool):
    """One chunk of the head terms.

    ``logits`` (c, V): z itself, or with ``markov`` (c, V) its head part U h, z being their
    float32 sum; ``teacher`` (P, V): ``teacher_logits``'s table, ``teacher_rows`` (c,) long each
    row's position in it, ``teacher_lse`` (P,) float32 the table's log-sum-exp; labels (c,),
    slot weights (c,) float32.

    Returns w (a CE + b L1) (c,), L1 (c,), argmax hits (c,) and, with ``with_grad``, the
    gradient of the first with respect to z in ``logits``'s dtype (for the matmul back) and,
    with ``markov``, in its dtype too (the same tensor when the dtypes agree), else None twice.
    Plain torch, so that inductor fuses it: float32 lives in registers, the teacher's rows
    are read from the table where they lie, and each (c, V) input is read a few times, never
    written.
    """
    z = logits.float() if markov is None else logits.float() + markov.float()  # (c, V) the Markov-corrected logits
    top, argmax = z.max(dim=-1)  # (c,)
    lse = top + (z - top[:, None]).exp().sum(dim=-1).log()  # (c,)
    q = (z - lse[:, None]).exp()  # (c, V) the draft distribution
    ce = lse - z.gather(1, labels[:, None]).squeeze(1)  # (c,)
    p = (teacher[teacher_rows].float() - teacher_lse[teacher_rows][:, None]).exp()  # (c, V) the target's: no gradient
    l1 = (q - p).abs().sum(dim=-1)  # (c,)
    loss = (ce_alpha * ce + l1_alpha * l1) * slot_w
    hit = argmax == labels
    if not with_grad:
        return loss, l1, hit, None, None
    sign = (q - p).sign()  # d|x|/dx, 0 at 0 as autograd's abs
    spread = (sign * q).sum(dim=-1, keepdim=True)  # (c, 1)
    onehot = torch.arange(z.shape[1], device=z.device) == labels[:, None]  # (c, V), fuses as a where
    grad = (ce_alpha * torch.where(onehot, q - 1, q) + l1_alpha * q * (sign - spread)) * slot_w[:, None]
    return loss, l1, hit, grad.to(logits.dtype), None if markov is None else grad.to(markov.dtype)


def chunk_kernel(device: torch.device, compiled: bool):
    """The chunk function the walk runs: on CUDA with Triton the three-pass kernel
    (training/dspark_kernel.py), else ``dspark_chunk_terms`` compiled, or eager when not ``compiled``."""
    if not compiled:
        return dspark_chunk_terms
    if ce_kernel.available(device):
        return dspark_kernel.dspark_terms
    # The table's row count follows b * T, which natural (unpacked) rows vary: dynamic=None lets
    # dynamo compile one graph for every count instead of one per count.
    return compiled_kernel(dspark_chunk_terms, dynamic=None)


def _row_lse(logits: torch.Tensor) -> torch.Tensor:
    """(c,) float32 log-sum-exp of logits (c, V), in float32 whatever their dtype."""
    return torch.logsumexp(logits.float(), dim=-1)


@torch.no_grad()
def teacher_logits(final: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, chunk_size: int,
                   fixed: bool, compiled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's logits of the target's final hidden states ``final`` (b, T, H) at every
    position, (P, V) in the head's dtype with P = b * T (rounded up to whole chunks when
    ``fixed``; those rows are never read), and their log-sum-exp (P,) float32: the teacher's
    distribution softmax(U s) of every slot, computed once per position."""
    s = final.flatten(0, 1).to(weight.dtype)  # (b * T, H)
    if fixed:
        s = F.pad(s, (0, 0, 0, -s.shape[0] % chunk_size))
    table = torch.empty(s.shape[0], weight.shape[0], dtype=weight.dtype, device=s.device)  # (P, V)
    lse = torch.empty(s.shape[0], dtype=torch.float32, device=s.device)  # (P,)
    row_lse = compiled_kernel(_row_lse) if compiled else _row_lse
    for start in range(0, s.shape[0], chunk_size):
        sl = slice(start, start + chunk_size)
        if bias is None:  # written into the table's rows (contiguous), not copied there
            torch.mm(s[sl], weight.t(), out=table[sl])
        else:
            torch.addmm(bias, s[sl], weight.t(), out=table[sl])
        lse[sl] = row_lse(table[sl])
    return table, lse


@dataclass
class _HeadWalk:
    """How ``_HeadTerms`` walks the supervised slots."""

    chunk_size: int
    kernel: object  # dspark_chunk_terms, or its compiled version
    fixed: bool  # every chunk chunk_size rows, the last one padded (one compiled shape)
    ce_alpha: float
    l1_alpha: float
    markov_dtype: torch.dtype  # the Markov term's matmuls run in it


def _head_walk(h, e, w2, teacher, weight, bias, labels, slot_w, walk: _HeadWalk, with_grad: bool):
    """sum w (a CE + b L1) over the M rows, their L1 (M,) and hits (M,), and with ``with_grad``
    the gradients of the sum for h (M, H), e (M, r) and W2 (V, r). ``teacher``: the table,
    each row's position in it (M,) long and the table's log-sum-exp (``teacher_logits``).

    Padding rows are zero inputs with label 0, teacher row 0 and weight 0: finite terms times
    0, zero gradient rows; their L1, hits and gradient rows are cut off at the end.
    """
    table, rows, table_lse = teacher
    m, width = h.shape
    pad = -m % walk.chunk_size if walk.fixed else 0
    if pad:
        h, e = (F.pad(x, (0, 0, 0, pad)) for x in (h, e))
        labels, slot_w, rows = F.pad(labels, (0, pad)), F.pad(slot_w, (0, pad)), F.pad(rows, (0, pad))
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    l1 = torch.empty(m + pad, dtype=torch.float32, device=h.device)
    hit = torch.empty(m + pad, dtype=torch.bool, device=h.device)
    grads = (torch.empty_like(h), torch.empty_like(e), torch.zeros_like(w2, dtype=torch.float32)) if with_grad else None
    w2_m = w2.to(walk.markov_dtype)  # (V, r)
    # One matmul for U h + W2 e when both run in one dtype: [U ; W2] side by side, (V, H + r).
    joint = torch.cat([weight, w2_m], dim=1) if walk.markov_dtype == weight.dtype else None
    for start in range(0, m + pad, walk.chunk_size):
        sl = slice(start, start + walk.chunk_size)
        e_m = e[sl].to(walk.markov_dtype)  # (c, r)
        if joint is not None:
            logits, markov = F.linear(torch.cat([h[sl].to(weight.dtype), e_m], dim=1), joint, bias), None  # (c, V)
        else:
            logits, markov = F.linear(h[sl].to(weight.dtype), weight, bias), F.linear(e_m, w2_m)  # (c, V) twice
        loss, l1[sl], hit[sl], grad_z, grad_markov = walk.kernel(
            logits, markov, table, rows[sl], table_lse, labels[sl], slot_w[sl], walk.ce_alpha, walk.l1_alpha,
            with_grad)
        total += loss.sum()
        if with_grad:
            if joint is not None:
                grad_in = grad_z @ joint  # (c, H + r)
                grads[0][sl], grads[1][sl], grad_markov = grad_in[:, :width], grad_in[:, width:], grad_z
            else:
                grads[0][sl], grads[1][sl] = grad_z @ weight, grad_markov @ w2_m  # (c, H), (c, r)
            grads[2].add_(grad_markov.t() @ e_m)  # (V, r), summed in float32
    if grads is not None:
        grads = (grads[0][:m], grads[1][:m], grads[2].to(w2.dtype))
    return total, l1[:m], hit[:m], grads


class _HeadTerms(torch.autograd.Function):
    """sum_i w_i (a CE_i + b L1_i) of z_i = U h_i + W2 e_i, with gradients for h, e and W2
    computed during the forward (``_head_walk``) and scaled in backward; also returns L1 and
    the argmax hits, both without gradient."""

    @staticmethod
    def forward(ctx, h, e, w2, teacher, weight, bias, labels, slot_w, walk):
        # h (M, H) in the drafter's dtype, e (M, r), labels (M,), slot_w (M,) float32; teacher as _head_walk's
        with_grad = any(ctx.needs_input_grad[:3])
        total, l1, hit, grads = _head_walk(h, e, w2, teacher, weight, bias, labels, slot_w, walk, with_grad)
        ctx.save_for_backward(*(grads or ()))
        ctx.mark_non_differentiable(l1, hit)
        return total, l1, hit

    @staticmethod
    def backward(ctx, grad_total, _grad_l1, _grad_hit):
        scaled = tuple(g * grad_total.to(g.dtype) for g in ctx.saved_tensors)
        return (*scaled, None, None, None, None, None, None)


def dspark_loss(drafter, hidden: torch.Tensor, labels: torch.Tensor, block_ids: torch.Tensor,
                anchors: torch.Tensor, final: torch.Tensor, lm_head: torch.nn.Module, weights: torch.Tensor,
                chunk_size: int, alphas: DSparkLossWeights, index: torch.Tensor | None = None, *,
                fused: bool | None = None, compiled: bool = True) -> LossOutput:
    """The weighted DSpark loss of drafter outputs ``hidden`` (b, Q, H).

    ``drafter``: the DSparkDraftModel (its Markov and confidence heads); ``labels`` (b, Q)
    DSpark labels; ``block_ids`` (b, Q) the block inputs (the anchor token at slot 0);
    ``anchors`` (b, N); ``final`` (b, T, H) the target's final hidden states; ``weights``
    (B,) exp(-k/gamma). ``correct`` and ``count`` have B + 1 entries, entry k + 1 for slot k
    (the k+1-th token after the anchor, the position DFlash's slot k + 1 predicts), entry 0
    unused: the accuracy logs of both kinds then name the same token. ``index`` as
    ``dflash_loss``'s; ``fused`` the fixed-size chunks in the head's dtype (default: on CUDA),
    ``compiled`` False runs their function eagerly (tests, debugging).
    """
    rows = supervised_rows(drafter, hidden, labels, block_ids, weights, index)
    block_size, dtype = weights.numel(), lm_head.weight.dtype
    if fused is None:
        fused = hidden.is_cuda
    compile_ = fused and compiled
    head_bias = getattr(lm_head, "bias", None)
    table, table_lse = teacher_logits(final, lm_head.weight, head_bias, chunk_size, fused, compile_)
    teacher = (table, teacher_index(rows.index, anchors, block_size, final.shape[1]), table_lse)
    kernel = chunk_kernel(hidden.device, compile_)
    w2 = drafter.markov_head.markov_w2.weight  # (V, r)
    if not torch.is_grad_enabled():
        # needs_input_grad reports a parameter as needing its gradient even under no_grad
        # (validation): detached, the walk computes none (on a CPU without bf16 units the
        # gradient matmuls were 5/6 of a bf16 validation's time).
        w2 = w2.detach()
    # The head in its own dtype (the target's). The Markov term: on the fused walk in the head's
    # dtype too, like everything there over the vocabulary. A float32 (c, r) x (r, V) matmul
    # runs without tensor cores: the Markov term's three per chunk are 11.5 TFLOP a step of the
    # one-H100 recipe, about 0.2 s at an H100's float32 rate (estimated, not measured), as much
    # as its whole DFlash step; DeepSpec trains the drafter in bf16. On the plain walk in its
    # weights' dtype: on CPUs without bf16 units bf16 matmuls are the slower ones. The
    # gradients are kept, and scaled in backward, in the dtypes of h, e and W2.
    walk = _HeadWalk(chunk_size, kernel, fused, alphas.ce, alphas.l1, dtype if fused else w2.dtype)
    head_sum, l1, hit = _HeadTerms.apply(rows.h, rows.e, w2, teacher, lm_head.weight, head_bias, rows.y, rows.w,
                                         walk)
    return loss_output(drafter, rows, labels, block_size, alphas, head_sum, l1, hit)


@dataclass
class SupervisedRows:
    """The supervised slots of a DSpark step, gathered once: their flat indices ``index`` (M,),
    slot in the block ``slot``, drafter outputs ``h`` (M, H), labels ``y``, the Markov head's
    embedding ``e`` (M, r) of each slot's gold predecessor, and slot weights ``w`` float32."""

    index: torch.Tensor
    slot: torch.Tensor
    h: torch.Tensor
    y: torch.Tensor
    e: torch.Tensor
    w: torch.Tensor


def supervised_rows(drafter, hidden, labels, block_ids, weights, index) -> SupervisedRows:
    """``dspark_loss``'s arguments of the same names, gathered at the supervised slots."""
    block_size = weights.numel()
    if index is None:
        index = (labels.flatten() != IGNORE_INDEX).nonzero().squeeze(1)  # (M,)
    index = index.to(labels.device, non_blocking=True)
    slot = index % labels.shape[1] % block_size  # (M,)
    prev = previous_tokens(labels, block_ids, block_size).flatten().index_select(0, index)  # (M,)
    return SupervisedRows(
        index=index, slot=slot, h=hidden.flatten(0, 1).index_select(0, index),  # (M, H)
        y=labels.flatten().index_select(0, index), e=drafter.markov_head.embed(prev),  # (M,), (M, r)
        w=weights.to(hidden.device, torch.float32, non_blocking=True).index_select(0, slot))


def loss_output(drafter, rows: SupervisedRows, labels, block_size: int, alphas: DSparkLossWeights,
                head_sum: torch.Tensor, l1: torch.Tensor, hit: torch.Tensor) -> LossOutput:
    """The step's LossOutput from the head terms' weighted sum, each slot's L1 and argmax hits:
    the confidence head's BCE added, the per-slot counts and the accepted drafts."""
    h, e, w, slot = rows.h, rows.e, rows.w, rows.slot
    accept = (1 - 0.5 * l1).clamp(0, 1)  # the chance the slot is accepted, given its prefix was
    conf = drafter.confidence_head(h, e)  # (M,)
    bce = F.binary_cross_entropy_with_logits(conf, accept, reduction="none")
    total = head_sum + (w * (alphas.confidence * bce)).sum()
    zeros = torch.zeros(block_size + 1, dtype=torch.float32, device=h.device)
    count = zeros.scatter_add(0, slot + 1, torch.ones_like(w))
    correct = zeros.scatter_add(0, slot + 1, hit.float())
    # Every slot drafts (slot 0 the first token after the anchor), each after its gold predecessor.
    accepted = accepted_drafts(rows.index, hit, labels.numel(), block_size, first_slot=0)
    return LossOutput(weighted_sum=total, weight_sum=w.sum(), correct=correct, count=count,
                      blocks=supervised_blocks(labels, block_size), accepted=accepted)
