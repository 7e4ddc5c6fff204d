"""DFlash2's cheaper training formulations against the first ones, kept as references in
benchmarks/dflash2_parts.py (which times both): the convolution without kernels widened to H
channels, and the selector's candidates taken from the DFlash loss's own logits (no second pass
of the head, no gathered (M, K, H) head rows). Same values and gradients in float32, on random
inputs."""

import pytest
import torch
from torch import nn

from benchmarks.dflash2_conv_bytes import convolve_pad
from benchmarks.dflash2_parts import selector_term_reference, wrap_reference
from dflash_train.contract import IGNORE_INDEX
from dflash_train.model.dflash2 import DFlash2Config, DFlash2DraftModel, GroupedDynamicCausalConv
from dflash_train.training.loss import Distillation, dflash_loss, selector_term
from tests.conftest import make_tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")

TIGHT = dict(rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- convolution
def _values_and_grads(modules, h, fn):
    for m in modules:
        m.zero_grad()
    h = h.detach().requires_grad_()
    y = fn(h)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return [y.detach(), h.grad] + [p.grad.clone() for m in modules for p in m.parameters()]


# (taps, channels per group, block size, queries): whole blocks (training) and one short block (inference)
@pytest.mark.parametrize("taps, group, block, queries", [(2, 16, 4, 12), (3, 4, 4, 12), (1, 1, 5, 10),
                                                          (4, 8, 16, 32), (2, 16, 16, 7), (3, 2, 4, 1)])
def test_convolution_equals_the_widened_kernel_formulation(taps, group, block, queries):
    torch.manual_seed(0)
    conv = GroupedDynamicCausalConv(hidden_size=64, kernel_size=taps, group_size=group, block_size=block)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_(0, 0.3)
    sublayer = nn.Sequential(nn.Linear(64, 64), nn.Tanh())
    h = torch.randn(2, queries, 64)
    got = _values_and_grads([conv, sublayer], h, lambda x: conv.wrap(sublayer, x))
    want = _values_and_grads([conv, sublayer], h, lambda x: wrap_reference(conv, sublayer, x))
    assert got[0].abs().max() > 0 and got[2].abs().max() > 0  # an output and a base-kernel gradient to compare
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **TIGHT)


# The model's convolution (a roll and a mask per tap, in a custom autograd.Function with its own
# backward) against the straightforward one autograd differentiates (each tap a pad and a slice:
# benchmarks/dflash2_conv_bytes.py `convolve_pad`, the model's formulation before): the same
# values and gradients, in float32 and in bf16 over float32 weights (the trainer's autocast),
# eager and traced (aot_eager: the graph inductor gets), with the kernel projection's scale,
# the inference widths (one block of at most block_size) and taps wider than a block included.
@pytest.mark.parametrize("taps, group, block, queries", [(2, 16, 16, 64), (3, 4, 4, 12), (2, 16, 16, 7), (3, 2, 4, 1),
                                                          (5, 8, 4, 8)])
@pytest.mark.parametrize("mode", ["float32", "bf16 autocast", "traced"])
def test_convolution_equals_the_padded_autograd_formulation(taps, group, block, queries, mode):
    torch.manual_seed(0)
    conv = GroupedDynamicCausalConv(hidden_size=64, kernel_size=taps, group_size=group, block_size=block)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_(0, 0.3)
    conv.kernel_projection.scale = 0.1
    sublayer = nn.Sequential(nn.Linear(64, 64), nn.Tanh())
    bf16 = mode == "bf16 autocast"
    h = torch.randn(2, queries, 64, dtype=torch.bfloat16 if bf16 else torch.float32)
    def run(fn):
        def step(x):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                return conv.wrap(sublayer, x)
        if fn is not None:
            conv.convolve = fn
        try:
            return _values_and_grads([conv, sublayer], h, torch.compile(step, backend="aot_eager", fullgraph=True)
                                     if mode == "traced" else step)
        finally:
            conv.__dict__.pop("convolve", None)
            torch._dynamo.reset()

    got = run(None)
    want = run(lambda x, deltas, side: convolve_pad(conv, x, deltas, side))
    assert got[0].abs().max() > 0 and got[2].abs().max() > 0 and got[3].abs().max() > 0
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # bit for bit: the same roundings, in the same order


# ------------------------------------------------------------------------------ selector
BLOCK, BLOCKS, SEQ, TOP_K = 4, 3, 20, 8


def _selector_case(bias: bool):
    """A DFlash2 drafter with random selector weights, a random head, 2 rows of 3 blocks whose
    labels are mostly among the head's top-K (so most slots have a selector term)."""
    target = make_tiny_target("qwen3", layers=4, seed=3)
    config = DFlash2Config.from_target(target.config, mask_token_id=96, num_hidden_layers=1, block_size=BLOCK,
                                       selector_rank=8, selector_top_k=TOP_K)
    torch.manual_seed(1)
    model = DFlash2DraftModel(config)
    with torch.no_grad():
        for p in model.candidate_selector.parameters():
            p.normal_(0, 0.3)
    head = nn.Linear(64, 97, bias=bias)
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, BLOCKS * BLOCK, 64, generator=gen)
    top = head(hidden).topk(TOP_K, dim=-1).indices  # (2, 12, K)
    pick = top.gather(2, torch.randint(0, TOP_K, (2, BLOCKS * BLOCK, 1), generator=gen)).squeeze(2)
    labels = torch.where(torch.rand(2, BLOCKS * BLOCK, generator=gen) < 0.8, pick,
                         torch.randint(0, 97, (2, BLOCKS * BLOCK), generator=gen))
    labels[:, ::BLOCK] = IGNORE_INDEX  # slot 0: the anchor, never supervised
    labels[1, -3:] = IGNORE_INDEX  # and a block cut short by the end of the answer
    anchors = torch.tensor([[1, 6, 12], [2, 9, 15]])
    input_ids = torch.randint(0, 97, (2, SEQ), generator=gen)
    weights = torch.tensor([0.0, 1.0, 0.7, 0.4])
    return model, head, hidden, labels, input_ids, anchors, weights


def _grads(model, hidden, total):
    params = [hidden, *model.candidate_selector.parameters()]
    return [total.detach(), *torch.autograd.grad(total, params)]


@pytest.mark.parametrize("walk", ["plain", "fused", "distill", "dpace"])
@pytest.mark.parametrize("bias", [False, True])
def test_selector_term_equals_the_second_head_pass_formulation(walk, bias):
    model, head, hidden, labels, input_ids, anchors, weights = _selector_case(bias)
    hidden.requires_grad_()
    chunk = 5  # several chunks, the last one short (padded on the fused walk)
    options = {"plain": {}, "fused": dict(fused=True, compiled=False), "dpace": dict(dpace_alpha=0.3),
               "distill": dict(distill=Distillation(torch.randn(2, SEQ, 64), anchors, weight=0.5))}[walk]
    out = dflash_loss(hidden, labels, head, weights, chunk, top_k=TOP_K, **options)
    got = _grads(model, hidden, selector_term(model, hidden, labels, input_ids, anchors, head, out.candidates)[0])
    row_weights = out.candidates.weights  # the slot weights, or the D-PACE weights of this forward
    reference, covered = selector_term_reference(model, hidden, labels, input_ids, anchors, head, row_weights, chunk)
    want = _grads(model, hidden, reference)
    assert covered >= 10 and want[0] > 0  # most of the 19 supervised slots have a selector term
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **TIGHT)


@pytest.mark.parametrize("fused", [False, True])
def test_keeping_the_candidates_leaves_the_dflash_loss_unchanged(fused):
    _model, head, hidden, labels, _ids, _anchors, weights = _selector_case(bias=True)
    hidden.requires_grad_()
    outs = [dflash_loss(hidden, labels, head, weights, 5, fused=fused, compiled=False, top_k=k) for k in (0, TOP_K)]
    assert outs[0].candidates is None
    grads = [torch.autograd.grad(o.weighted_sum, hidden)[0] for o in outs]
    assert torch.equal(outs[0].weighted_sum, outs[1].weighted_sum) and torch.equal(grads[0], grads[1])
    assert torch.equal(outs[0].correct, outs[1].correct)
    index = (labels.flatten() != IGNORE_INDEX).nonzero().squeeze(1)
    values, tokens = head(hidden.detach().flatten(0, 1)[index]).topk(TOP_K, dim=-1)
    assert torch.equal(outs[1].candidates.tokens, tokens)
    torch.testing.assert_close(outs[1].candidates.logits, values, **TIGHT)
