"""DFlash2 drafter: DFlash plus block-local dynamic convolutions and a candidate selector.

Copied beside a DFlash2 export as `dflash2.py`, next to `dflash.py`, which it imports
relatively (so `AutoModel.from_pretrained(dir, trust_remote_code=True)` finds both); like
that file it imports only torch and transformers.

What DFlash2 is, as z-lab (Inco AI) define it in their inference code: z-lab/dflash
`dflash/model.py` @ 10129599dffb338ff38cfd235a53ca6d3667b4dd (`GroupedDynamicCausalConv`,
`CandidateSelector`, `DFlash2DraftModel`, `dflash_generate`), checked against SGLang's
`models/dflash.py` after PR #35371 and `speculative/dflash_utils.py`
(`parse_dflash_draft_config`) @ 00731f0bc9fa81c39802754fb4b62e9cce967582, vLLM PR #52816
`qwen3_dflash2.py` @ 030da624231c394ea975df15248edd9adc9315da and z-lab's
`tests/fixtures/dflash2-config.json` @ 0a7587c0 / `dflash2-safetensors-header.json` @ 0698f537
(the research note: docs/design/dspark-dflash2.md section 4). Written from that description;
no code of theirs is copied.

The backbone, the block `[x[p], MASK * (B-1)]`, the same-position labels (slot k predicts
x[p+k], slot 0 unsupervised), the anchors and the visibility mask are DFlash's. Two things
are added:

1. In every layer, a grouped dynamic depthwise causal convolution (`attention_conv`,
   `mlp_conv`) wraps the input and the output of the attention and of the MLP sublayer:
       y[i, c] = sum_t (base[side, t, c] + delta[i, side, t, c // G]) * x[i - t, c]
   with Kc = conv_kernel_size taps (t = 0 the token itself), G = conv_group_size channels
   per group, and delta = kernel_projection(h) computed once from the sublayer's (normed)
   input h for both sides (side 0: the input, side 1: the output). Taps that reach before
   the block's first slot read zero: the convolution is causal and never crosses a block,
   so the anchor sees only itself. Only block tokens are convolved; the context features
   enter the attention's keys and values exactly as in DFlash.
2. A candidate selector over the unary logits U_j = lm_head(h_j) (h_j after the final
   norm): keep the top K = selector_top_k tokens of each slot and score a candidate c after
   the predecessor token `pred` with
       score_j(c) = U_j(c) + <A[pred] * P h_j, B[c]>
   (A, B: V x r codebooks, P: H -> r, r = selector_rank). Drafting walks one path from the
   anchor: pred_1 is the anchor token, pred_j the candidate chosen at slot j-1; greedy takes
   the best score, sampling draws from softmax(score / T) over the K candidates, and that
   distribution, scattered onto the vocabulary, is the q the target's rejection step reads.

Decisions where the authors published nothing (their repository is inference-only):
  * Training objective: DFlash's decayed CE on the unary logits (unchanged: the trainer's
    own loss, D-PACE and distillation options included) plus alpha * a K-way CE over the
    top-K candidates of each supervised slot, with the teacher-forced predecessor x[p+k-1]
    (the anchor for slot 1), weighted by the same per-slot weights (`selector_loss`).
    This is the consensus of the public trainers (SpecForge, speculators, TorchSpec, NeMo
    AutoModel); the details follow SpecForge and NeMo, the SGLang-aligned ones: a slot
    whose gold token is not in the unary top-K adds no selector term (what serving can
    pick from is exactly the top-K, so injecting the gold would train a case that never
    occurs), and the selector term is added to the unary numerator over the trainer's one
    global denominator. alpha = 1 (every public trainer's default). Each slot's selector CE
    has the weight its unary CE has, D-PACE's included (computed from the unary CE, then
    kept to the covered slots): SpecForge `specforge/core/dflash.py` post-PR #793
    (`_selector_chunk_terms`: `selector_loss_weights = loss_weights * target_is_candidate`,
    `loss_weights` the base objective's, D-PACE's under `loss_type=dpace`) and NeMo
    AutoModel `dflash2_core.py` @ 18ccd0466350739a95169cbd2713382fc32c15b4 (`weighted_mean`
    of the selector NLL with the base NLL's D-PACE schedule). (The first version here kept
    the contract's decay weights under D-PACE: about 6.6 per block of 16 against D-PACE's
    2 to 5, so the selector term outweighed the unary CE the drafts come from.)
    The top-K indices are chosen without gradient; the gradient reaches the K unary logits
    (so the backbone through the LM head), h through P, and A and B (SpecForge's default,
    `selector_stop_gradient=False`; NeMo detaches nothing). The trainer takes the top-K and
    their logits from the DFlash loss's own logits (training/loss.py), so the head runs once
    per slot.
  * What a DFlash2 drafter is measured by: its drafts are the walk's, so the trainer's
    per-slot accuracies (and the expected tau made of them, training and held-out) count
    the selector's pick after the gold predecessor, which is the walk's own pick whenever
    the slots before it were accepted (NeMo's `DFlash2StepMetrics`: the primary accuracy
    and acceptance length are the selector path's, `base_*` the unary argmax's; ours:
    `val_unary_expected_tau`).
  * Initialisation (SpecForge's): each convolution starts as the identity (base tap 0 = 1,
    other taps 0, kernel_projection 0) and the successor codebook B at 0, so a fresh DFlash2
    drafter computes exactly what a fresh DFlash drafter with the same backbone weights
    does, and its walk is the unary argmax; A and P start N(0, initializer_range). The
    backbone is drawn as DFlash's is: from the same seed, the same weights (the kernel
    projections draw no random numbers and the selector is drawn after the backbone), so
    two kinds trained from one seed start from one backbone.
  * output_multiplier, final_logit_softcapping and input_embedding_scale (for targets such
    as Muse/Gemma) are not implemented: a config setting them to anything but their
    neutral value is refused rather than served differently.
  * Every runtime (the reference loop, the static CUDA-graph one, the batched loops) picks
    drafts through `pick_drafts`: the walk is a fixed number of small batched steps with no
    host read, so the static runtime captures it in its graphs.

Shape legend (as dflash.py): b batch, Q block tokens, H hidden, V vocab, M supervised rows,
K candidates, r selector rank, Kc taps, G channels per group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .dflash import DecoderLayer, DFlashConfig, DFlashDraftModel, block_size_of, dflash_field

ARCHITECTURE = "DFlash2DraftModel"
CODE_NAME = "dflash2.py"
# The public checkpoints' values (z-lab/Qwen3.8-27B-DFlash2, incoai/Muse-Glimmer-30B-DFlash2).
DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
SIDES = 2  # a convolution's kernels: index 0 wraps the sublayer's input, 1 its output
INPUT_SIDE, OUTPUT_SIDE = 0, 1
# Keys other DFlash2 checkpoints use that this drafter does not implement: {key: neutral values}.
NEUTRAL = {"output_multiplier": (None, 1, 1.0), "final_logit_softcapping": (None, 0, 0.0),
           "input_embedding_scale": (None, 1, 1.0)}
# A training run's config attribute (drafter.dflash2.conv_delta_scale), set only when not 1:
# the export folds it into the kernel projections' weights (`fold_conv_delta_scale`) and
# never writes it, since SGLang and vLLM read no such key.
CONV_DELTA_SCALE = "conv_delta_scale"
TRAINING_ONLY = (CONV_DELTA_SCALE,)
# The state-dict names (their endings) of the tensors that scale multiplies.
KERNEL_PROJECTION_PARAMS = ("kernel_projection.weight", "kernel_projection.bias")


def check_dflash2(config) -> None:
    """ValueError naming the setting a DFlash2 config gets wrong."""
    nested = getattr(config, "dflash_config", None) or {}
    missing = [k for k in DEFAULTS if k not in nested]
    if missing:
        raise ValueError(f"a DFlash2 drafter needs dflash_config.{missing[0]} (SGLang and vLLM read it there only)")
    kc, g = nested["conv_kernel_size"], nested["conv_group_size"]
    r, k = nested["selector_rank"], nested["selector_top_k"]
    block, hidden, vocab = block_size_of(config), config.hidden_size, config.vocab_size
    if not isinstance(kc, int) or not 1 <= kc <= block:
        raise ValueError(f"conv_kernel_size={kc!r} must be an integer in 1..block_size={block}")
    if not isinstance(g, int) or g < 1 or hidden % g:
        raise ValueError(f"conv_group_size={g!r} must be a positive divisor of hidden_size={hidden}")
    if not isinstance(r, int) or r < 1:
        raise ValueError(f"selector_rank={r!r} must be a positive integer")
    if not isinstance(k, int) or not 1 <= k <= vocab:
        raise ValueError(f"selector_top_k={k!r} must be an integer in 1..vocab_size={vocab}")
    for key, neutral in NEUTRAL.items():
        value = dflash_field(config, key)
        if value not in neutral:
            raise ValueError(f"dflash_config.{key}={value!r} is not implemented here (only {neutral[-1]})")


class DFlash2Config(DFlashConfig):
    """DFlashConfig plus the four DFlash2 fields, kept in `dflash_config` (where SGLang and
    vLLM read them, with no top-level fallback)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.architectures = [ARCHITECTURE]
        self.auto_map = {"AutoModel": "dflash2.DFlash2DraftModel"}

    @classmethod
    def from_target(cls, target_config, *, conv_kernel_size: int = DEFAULTS["conv_kernel_size"],
                    conv_group_size: int = DEFAULTS["conv_group_size"], selector_rank: int = DEFAULTS["selector_rank"],
                    selector_top_k: int = DEFAULTS["selector_top_k"], conv_delta_scale: float = 1.0,
                    **kwargs) -> "DFlash2Config":
        """``conv_delta_scale``: a training run's (module docstring); 1 leaves the config as it was."""
        config = super().from_target(target_config, **kwargs)
        config.dflash_config.update(conv_kernel_size=int(conv_kernel_size), conv_group_size=int(conv_group_size),
                                    selector_rank=int(selector_rank), selector_top_k=int(selector_top_k))
        if conv_delta_scale != 1:
            setattr(config, CONV_DELTA_SCALE, float(conv_delta_scale))
        check_dflash2(config)
        return config


def conv_delta_scale(config) -> float:
    """The factor a drafter of ``config`` multiplies its kernel projections' weights by: a
    training run's drafter.dflash2.conv_delta_scale, 1 for every exported or loaded drafter."""
    return float(getattr(config, CONV_DELTA_SCALE, 1.0))


def fold_conv_delta_scale(state: dict, scale: float) -> dict:
    """``state`` with each kernel projection's weight (and bias, if any) multiplied by ``scale``,
    the tensor the training forward used (``KernelProjection.forward``: the same product in
    the same dtype, so the folded drafter computes bit for bit what the trained one did)."""
    if scale == 1:
        return state
    return {k: v * scale if k.endswith(KERNEL_PROJECTION_PARAMS) else v for k, v in state.items()}


class KernelProjection(nn.Linear):
    """The convolution's kernel predictor: a Linear that starts (and resets) at zero without
    drawing random numbers, so a DFlash2 drafter's backbone draws exactly what a DFlash
    drafter's does from the same seed (``DFlash2DraftModel._init_weights``).

    ``scale`` (a training run's conv_delta_scale, 1 otherwise) multiplies the weight (and
    bias) inside this module's own forward, where a sharding backend has gathered them:
    the gradient reaching the weight is scaled by it, and at 0 it is zero."""

    scale: float = 1.0

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale == 1:
            return super().forward(x)
        return F.linear(x, self.weight * self.scale, None if self.bias is None else self.bias * self.scale)


def shifted_in_block(xs: torch.Tensor, t: int) -> torch.Tensor:
    """xs[:, :, i - t] for each slot i of each block (dim 2 of xs: (b, N, L, ...)), zero where
    i - t is outside the block: t > 0 reads earlier slots (a tap's x[i - t], never from the block
    before), t < 0 later ones (its transpose, in the backward). A roll inside the block and a
    mask, which inductor reads in place (a pad and a slice it wrote out, once per tap)."""
    if t == 0:
        return xs
    slot = torch.arange(xs.shape[2], device=xs.device).view(-1, *(1,) * (xs.dim() - 3))
    inside = slot >= t if t > 0 else slot < xs.shape[2] + t
    return torch.where(inside, xs.roll(t, 2), 0)


def convolve_blocks(xs: torch.Tensor, delta: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """sum_t (base[t] + delta[..., t]) * x[i - t]: xs (b, N, L, g, G), delta (b, N, L, Kc, g, 1),
    base (Kc, g, G); the product rounded to x's dtype per tap, as `convolve` documents."""
    out = None
    for t in range(base.shape[0]):
        term = shifted_in_block(xs, t) * (base[t] + delta[:, :, :, t]).to(xs.dtype)  # (b, N, L, g, G)
        out = term if out is None else out + term
    return out


class _BlockConvolution(torch.autograd.Function):
    """`convolve_blocks` with its own backward, which keeps only x, the deltas and a copy of the
    base kernel (Kc x H values; a copy, so a sharding backend may free the gathered parameter).

    Why (benchmarks/dflash2-conv-cpu-2026-11-28, inductor's byte estimates of one compiled
    layer of the one-H100 recipe): with autograd's own backward inductor wrote each tap's
    shifted x in the forward, autograd kept it and the kernels, and the backward ran two
    reductions (over G for the deltas, over the tokens for the base) per tap, each reading dy
    and x again. Here the backward forms all taps' products dy[i] * x[i - t] as one
    (b, N, L, Kc, g, G) expression summed once over G and once over the tokens: the same
    values and gradients (the same roundings; only the order of the float32 sums can differ),
    36% fewer bytes moved by the convolutions (fwd+bwd) and 64% fewer kept for the backward
    (a GPU step not measured). Eager (drafter.compile=false), the backward's product is a
    transient Kc x (b, Q, H) float32 tensor."""

    @staticmethod
    def forward(ctx, xs, delta, base):
        ctx.save_for_backward(xs, delta, base.detach().clone())
        return convolve_blocks(xs, delta, base)

    @staticmethod
    def backward(ctx, dy):
        xs, delta, base = ctx.saved_tensors
        width, taps = xs.shape[2], base.shape[0]
        dx = None
        for t in reversed(range(taps)):  # x[j] feeds y[j + t] with j + t's kernel; autograd's order of the sum
            back = shifted_in_block(dy * (base[t] + delta[:, :, :, t]).to(xs.dtype), -t)
            dx = back if dx is None else dx + back
        i = torch.arange(width, device=xs.device)[:, None] - torch.arange(taps, device=xs.device)  # (L, Kc): i - t
        shifted = torch.where((i >= 0)[:, :, None, None], xs[:, :, i.clamp(min=0)], 0)  # (b, N, L, Kc, g, G)
        prod = (dy[:, :, :, None] * shifted).float()  # rounded to x's dtype, as autograd's product is
        return (dx, prod.sum(-1, keepdim=True).to(delta.dtype),
                prod.sum((0, 1, 2)).to(base.dtype))


class GroupedDynamicCausalConv(nn.Module):
    """Depthwise causal convolution inside each block, with per-token per-group kernels."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int):
        super().__init__()
        self.kernel_size, self.group_size, self.block_size = kernel_size, group_size, block_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(SIDES, kernel_size, hidden_size))  # (2, Kc, H)
        self.kernel_projection = KernelProjection(hidden_size, SIDES * kernel_size * self.groups, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The identity: tap 0 passes each channel through, nothing is predicted yet."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def deltas(self, h: torch.Tensor) -> torch.Tensor:
        """(b, Q, 2, Kc, groups): the predicted part of both sides' kernels, one value per group
        of G channels, from the sublayer input h (b, Q, H) (times the projection's ``scale``).
        Never widened to H channels: the convolution broadcasts it over each group's channels."""
        return self.kernel_projection(h).view(*h.shape[:2], SIDES, self.kernel_size, self.groups)

    def convolve(self, x: torch.Tensor, deltas: torch.Tensor, side: int) -> torch.Tensor:
        """y[i] = sum_t (base[side, t] + deltas[i, side, t]) * x[i - t], zero where i - t is before
        i's block: (b, Q, H).

        The query stream is whole blocks of `block_size` (training: N*B tokens) or one block
        of at most `block_size` (inference). Seen as (b, blocks, slots, groups, G), a tap's
        x[i - t] is the slots rolled by t inside each block with the first t slots zeroed:
        the whole packed stream at once, and no block ever reads another.
        """
        b, q, hidden = x.shape
        width = min(q, self.block_size)  # slots per block
        xs = x.view(b, q // width, width, self.groups, self.group_size)  # (b, N, L, g, G)
        delta = deltas[:, :, side].reshape(b, q // width, width, self.kernel_size, self.groups, 1)  # (b,N,L,Kc,g,1)
        base = self.base_kernel[side].view(self.kernel_size, self.groups, self.group_size)  # (Kc, g, G)
        if torch.is_grad_enabled() and (x.requires_grad or delta.requires_grad or base.requires_grad):
            return _BlockConvolution.apply(xs, delta, base).view(b, q, hidden)
        return convolve_blocks(xs, delta, base).view(b, q, hidden)  # inference: the same forward

    def wrap(self, sublayer: nn.Module, h: torch.Tensor, *args) -> torch.Tensor:
        """sublayer(conv_in(h)) convolved again; both kernels come from the sublayer input h."""
        deltas = self.deltas(h)
        return self.convolve(sublayer(self.convolve(h, deltas, INPUT_SIDE), *args), deltas, OUTPUT_SIDE)


class DFlash2DecoderLayer(DecoderLayer):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        nested = config.dflash_config
        args = (config.hidden_size, nested["conv_kernel_size"], nested["conv_group_size"], block_size_of(config))
        self.attention_conv = GroupedDynamicCausalConv(*args)
        self.mlp_conv = GroupedDynamicCausalConv(*args)

    def forward(self, x, ctx, cos, sin, mask, cache):
        x = x + self.attention_conv.wrap(self.self_attn, self.input_layernorm(x), ctx, cos, sin, mask, cache)
        return x + self.mlp_conv.wrap(self.mlp, self.post_attention_layernorm(x))


class CandidateSelector(nn.Module):
    """Pair scores <A[pred] * P h, B[c]> of candidate tokens c after a predecessor token."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int):
        super().__init__()
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)  # P
        # Raw tensors, no `.weight`: the checkpoint names SGLang and vLLM load.
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))  # A (V, r)
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))  # B (V, r)

    @torch.no_grad()
    def reset_parameters(self, std: float) -> None:
        """B = 0: a fresh selector adds nothing and the walk is the unary argmax."""
        nn.init.normal_(self.hidden_projection.weight, std=std)
        nn.init.normal_(self.predecessor_codebook, std=std)
        self.successor_codebook.zero_()

    def forward(self, h: torch.Tensor, pred: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
        """(M, K) float32 pair scores. h (M, H), pred (M,) token ids, cand (M, K) token ids.

        The codebook rows are read with F.embedding, not ``codebook[ids]``: the values are the
        same, but an indexed read's backward is a sorted index_put that adds the rows of each
        repeated id one after another, and a training step's top-K candidates repeat the common
        tokens tens of thousands of times (42 ms of a 0.5B recipe's H100 step); the embedding
        backward sums the repeats in parallel segments."""
        query = F.embedding(pred, self.predecessor_codebook) * self.hidden_projection(
            h.to(self.hidden_projection.weight.dtype))  # (M, r)
        return torch.einsum("mr,mkr->mk", query.float(), F.embedding(cand, self.successor_codebook).float())


class DFlash2DraftModel(DFlashDraftModel):
    config_class = DFlash2Config
    layer_class = DFlash2DecoderLayer
    _no_split_modules = ["DFlash2DecoderLayer"]

    @property
    def modules_called_outside_forward(self) -> list[nn.Module]:
        """Modules the training loss calls itself, after the forward: a sharding backend
        wraps each on its own so that calling it gathers its parameters (FSDP2, ZeRO-3)."""
        return [self.candidate_selector]

    def __init__(self, config):
        check_dflash2(config)
        super().__init__(config)
        nested = config.dflash_config
        self.selector_top_k = nested["selector_top_k"]
        self.candidate_selector = CandidateSelector(config.hidden_size, config.vocab_size, nested["selector_rank"])
        self.reset_dflash2_parameters()
        scale = conv_delta_scale(config)
        if scale != 1:
            for module in self.modules():
                if isinstance(module, KernelProjection):
                    module.scale = scale

    def reset_dflash2_parameters(self) -> None:
        """The DFlash2 modules' starting values (the module docstring's initialisation)."""
        for module in self.modules():
            if isinstance(module, GroupedDynamicCausalConv):
                module.reset_parameters()
        self.candidate_selector.reset_parameters(getattr(self.config, "initializer_range", 0.02))

    def _init_weights(self, module):
        # Also reached when transformers initialises weights a checkpoint lacks. The kernel
        # projections draw nothing (DFlash's _init_weights would draw them as any Linear), and
        # the selector is built after post_init: the backbone is DFlash's from the same seed.
        if isinstance(module, KernelProjection):
            module.reset_parameters()
            return
        super()._init_weights(module)
        if isinstance(module, GroupedDynamicCausalConv):
            module.reset_parameters()
        elif isinstance(module, CandidateSelector):
            module.reset_parameters(getattr(self.config, "initializer_range", 0.02))

    def selector_loss(self, h: torch.Tensor, pred: torch.Tensor, gold: torch.Tensor, cand: torch.Tensor,
                      unary: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum_i w_i * covered_i * CE_K(score_i, gold_i), selector hits (M,) bool).

        h (M, H): supervised rows of the drafter's output (after the final norm); pred (M,):
        each row's teacher-forced predecessor x[p+k-1]; gold (M,): its label x[p+k];
        cand (M, K): the row's unary top-K tokens, a choice made without gradient; unary (M, K)
        float32: their logits lm_head(h), differentiable in h (the trainer takes both from the
        DFlash loss's own logits: training/loss.py ``selector_term``); weights (M,) float32.
        A row whose gold token is outside its unary top-K adds nothing (and counts as a miss).
        """
        score = unary + self.candidate_selector(h, pred, cand)  # (M, K)
        match = cand == gold[:, None]  # (M, K)
        covered = match.any(dim=1)
        ce = F.cross_entropy(score, match.float().argmax(dim=1), reduction="none")  # (M,)
        total = (ce * weights * covered).sum()
        hits = covered & (score.argmax(dim=1) == match.float().argmax(dim=1))
        return total, hits

    def pick_drafts(self, target, hidden: torch.Tensor, anchor: torch.Tensor, count: int, sampling, generator):
        """The first `count` drafts of each row's block by the selector's walk from its anchor
        (b, count), and the distribution each was drawn from (b, count, V) (None when greedy):
        softmax(score / T) over the slot's K candidates, zero elsewhere (the arguments as
        DFlashDraftModel.pick_drafts's)."""
        h = hidden[:, 1 : count + 1]  # (b, n, H)
        logits = target.get_output_embeddings()(h).float()  # (b, n, V)
        unary, cand = logits.topk(self.selector_top_k, dim=-1)  # (b, n, K)
        probs = None if sampling.greedy else torch.zeros_like(logits)
        pred, drafts = anchor, []  # pred (b,): the token before slot j, the anchor for slot 1
        for j in range(count):
            score = unary[:, j] + self.candidate_selector(h[:, j], pred, cand[:, j])  # (b, K)
            if sampling.greedy:
                choice = score.argmax(-1)  # (b,)
            else:
                q = torch.softmax(score / sampling.temperature, dim=-1)
                choice = torch.multinomial(q, 1, generator=generator)[:, 0]
                probs[:, j].scatter_(-1, cand[:, j], q)
            pred = cand[:, j].gather(1, choice[:, None])[:, 0]
            drafts.append(pred)
        return torch.stack(drafts, 1), probs
