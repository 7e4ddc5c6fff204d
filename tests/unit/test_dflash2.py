"""drafter.kind=dflash2 (model/dflash2.py): the block-local convolution, the candidate
selector's scores and loss on hand-checkable numbers, training and resuming on CPU, and the
selector's walk in the reference runtime."""

import math

import pytest
import torch
from torch import nn

from dflash_train.contract import block_input_ids, block_position_ids
from dflash_train.model.dflash import FULL_ATTENTION, DFlashConfig, DFlashDraftModel, Sampling, visible_mask
from dflash_train.model.dflash2 import (
    CandidateSelector,
    DFlash2Config,
    DFlash2DraftModel,
    GroupedDynamicCausalConv,
)
from dflash_train.training.loss import dflash_loss, selector_term
from dflash_train.training.trainer import Trainer
from tests.conftest import make_tiny_target
from tests.train_data import tiny_inputs, tiny_train_config

pytestmark = pytest.mark.usefixtures("one_thread")

MASK_ID = 96  # the tiny target's last row


def _drafter(target, seed=0, randomise=True, **kw):
    kw = {"num_hidden_layers": 2, "block_size": 4, "selector_rank": 8, "selector_top_k": 4, **kw}
    config = DFlash2Config.from_target(target.config, mask_token_id=MASK_ID, **kw)
    torch.manual_seed(seed)
    model = DFlash2DraftModel(config).eval()
    if randomise:  # the identity / zero starting values would hide the convolution and the selector
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "conv" in name or "selector" in name:
                    p.normal_(0, 0.3)
    return model


# ----------------------------------------------------------------------------- convolution
def test_kernel_shapes_follow_the_public_layout():
    conv = GroupedDynamicCausalConv(hidden_size=64, kernel_size=2, group_size=16, block_size=4)
    assert tuple(conv.base_kernel.shape) == (2, 2, 64)  # (side, tap, channel)
    assert tuple(conv.kernel_projection.weight.shape) == (2 * 2 * 64 // 16, 64)
    names = set(_drafter(make_tiny_target()).state_dict())
    for i in range(2):
        for which in ("attention_conv", "mlp_conv"):
            assert {f"layers.{i}.{which}.base_kernel", f"layers.{i}.{which}.kernel_projection.weight"} <= names
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight"} <= names


def test_a_group_of_channels_shares_one_predicted_kernel():
    # H = 8 in 2 groups of 4, 2 taps; only the row of (side 0, tap 1, group 1) reads h[..., 0].
    conv = GroupedDynamicCausalConv(hidden_size=8, kernel_size=2, group_size=4, block_size=4)
    with torch.no_grad():
        conv.base_kernel.zero_()
        conv.kernel_projection.weight.zero_()
        conv.kernel_projection.weight[0 * 4 + 1 * 2 + 1, 0] = 1.0  # index (side, tap, group) in a (2, 2, 2) view
    h = torch.zeros(1, 3, 8)
    h[0, :, 0] = torch.tensor([1.0, 2.0, 3.0])
    d = conv.deltas(h)  # (1, 3, 2, 2, 2): one value per group
    assert torch.equal(d[0, :, 0, 1], torch.tensor([[0.0, 1.0], [0.0, 2.0], [0.0, 3.0]]))
    assert d[0, :, 1].abs().sum() == 0 and d[0, :, 0, 0].abs().sum() == 0
    # tap 1 of side 0 reads x[i - 1] with group 1's kernel on channels 4..7 and 0 on channels 0..3
    y = conv.convolve(torch.ones(1, 3, 8), d, side=0)
    assert torch.equal(y[0], torch.tensor([[0.0] * 8, [0.0] * 4 + [2.0] * 4, [0.0] * 4 + [3.0] * 4]))


def test_the_convolution_by_hand():
    # y[i] = k0[i] * x[i] + k1[i] * x[i-1], and x[i-1] reads zero at a block's first slot.
    conv = GroupedDynamicCausalConv(hidden_size=2, kernel_size=2, group_size=1, block_size=2)
    x = torch.tensor([[[1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [4.0, 40.0]]])  # two blocks of 2
    with torch.no_grad():
        conv.base_kernel.zero_()
        conv.base_kernel[1, 0] = 2.0  # side 1: 2 * x[i] + (0.25 + 0.25) * x[i-1]
        conv.base_kernel[1, 1] = 0.25
    deltas = torch.zeros(1, 4, 2, 2, 2)  # (b, Q, side, tap, group): the predicted part
    deltas[:, :, 1, 1] = 0.25
    y = conv.convolve(x, deltas, side=1)
    assert torch.equal(y, torch.tensor([[[2.0, 20.0], [4.5, 45.0], [6.0, 60.0], [9.5, 95.0]]]))


def test_fresh_convolutions_are_the_identity():
    conv = GroupedDynamicCausalConv(hidden_size=64, kernel_size=2, group_size=16, block_size=4)
    x = torch.randn(2, 8, 64)
    assert torch.equal(conv.wrap(nn.Identity(), x), x)


def test_convolution_is_causal_and_never_crosses_a_block():
    torch.manual_seed(0)
    conv = GroupedDynamicCausalConv(hidden_size=64, kernel_size=3, group_size=16, block_size=4)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_(0, 0.3)
    x = torch.randn(1, 12, 64)  # three blocks of 4
    y = conv.wrap(nn.Identity(), x)
    for changed in range(12):
        x2 = x.clone()
        x2[0, changed] += 1.0
        y2 = conv.wrap(nn.Identity(), x2)
        block, slot = divmod(changed, 4)
        same = [i for i in range(12) if i // 4 != block or i % 4 < slot]
        moved = [i for i in range(12) if i // 4 == block and i % 4 >= slot]
        assert torch.equal(y2[0, same], y[0, same]), changed  # exactly unchanged
        assert all(not torch.equal(y2[0, i], y[0, i]) for i in moved), changed


def test_training_forward_of_one_block_ignores_every_other_block():
    target = make_tiny_target("qwen3", layers=4, seed=3)
    drafter = _drafter(target, num_hidden_layers=1, target_layer_ids=[1, 2])
    t = 12
    seq = torch.randint(0, 90, (t,), generator=torch.Generator().manual_seed(1))
    anchors = torch.tensor([[2, 5, 8]])
    feats = torch.randn(1, t, 2 * target.config.hidden_size, generator=torch.Generator().manual_seed(2))
    positions = torch.cat([torch.arange(t), block_position_ids(torch.arange(t), anchors[0], 4).flatten()])[None]
    masks = {FULL_ATTENTION: visible_mask(anchors, t, 4)}

    def hidden(blocks):
        return drafter(target.get_input_embeddings()(blocks), feats, positions, masks)

    blocks = block_input_ids(seq, anchors[0], 4, MASK_ID).flatten()[None]  # (1, 12)
    base = hidden(blocks)
    other = blocks.clone()
    other[0, 4] = 7  # the second block's anchor token
    changed = hidden(other)
    assert torch.equal(changed[:, :4], base[:, :4]) and torch.equal(changed[:, 8:], base[:, 8:])
    assert not torch.equal(changed[:, 4:8], base[:, 4:8])


def test_fresh_dflash2_computes_what_dflash_does():
    # Identity convolutions and a zero successor codebook: the backbone is DFlash's exactly.
    target = make_tiny_target("qwen3", layers=4, seed=3)
    torch.manual_seed(0)
    two = DFlash2DraftModel(DFlash2Config.from_target(target.config, mask_token_id=MASK_ID, num_hidden_layers=2,
                                                      block_size=4, selector_rank=8, selector_top_k=4))
    one = DFlashDraftModel(DFlashConfig.from_target(target.config, mask_token_id=MASK_ID, num_hidden_layers=2,
                                                    block_size=4))
    one.load_state_dict({k: v for k, v in two.state_dict().items() if "conv" not in k and "selector" not in k})
    noise = torch.randn(1, 8, 64)
    feats = torch.randn(1, 5, 2 * 64)
    positions = torch.arange(13)[None]
    assert torch.equal(two(noise, feats, positions), one(noise, feats, positions))


@pytest.mark.parametrize("key, value", [("conv_group_size", 7), ("conv_kernel_size", 5), ("selector_top_k", 0),
                                        ("selector_rank", 0)])
def test_bad_settings_are_one_line_errors_naming_the_value(key, value):
    target = make_tiny_target()
    with pytest.raises(ValueError, match=rf"{key}={value}"):
        DFlash2Config.from_target(target.config, mask_token_id=MASK_ID, block_size=4, **{key: value})


# ------------------------------------------------------------------------------ selector
def _hand_selector():
    # H = 2, V = 4, r = 2: P = diag(1, 2), A[1] = (1, -1), B[0] = (1, 1), B[2] = (0.5, 2).
    sel = CandidateSelector(hidden_size=2, vocab_size=4, rank=2)
    with torch.no_grad():
        sel.hidden_projection.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 2.0]]))
        sel.predecessor_codebook.zero_()
        sel.predecessor_codebook[1] = torch.tensor([1.0, -1.0])
        sel.successor_codebook.zero_()
        sel.successor_codebook[0] = torch.tensor([1.0, 1.0])
        sel.successor_codebook[2] = torch.tensor([0.5, 2.0])
    return sel


def test_pair_score_golden_numbers():
    # h = (3, 1): P h = (3, 2); A[1] * P h = (3, -2); <., B[0]> = 1, <., B[2]> = 1.5 - 4 = -2.5.
    sel = _hand_selector()
    scores = sel(torch.tensor([[3.0, 1.0]]), torch.tensor([1]), torch.tensor([[0, 2, 3]]))
    assert scores.tolist() == [[1.0, -2.5, 0.0]]
    # another predecessor (A[0] = 0) adds nothing
    assert sel(torch.tensor([[3.0, 1.0]]), torch.tensor([0]), torch.tensor([[0, 2, 3]])).tolist() == \
        [[0.0, 0.0, 0.0]]


def _hand_loss_model():
    """A drafter shell whose selector is `_hand_selector` at top-K 2, and a head with
    logits h0 * (2, 1, 0, -1) for tokens 0..3."""
    config = DFlash2Config.from_target(make_tiny_target().config, mask_token_id=MASK_ID, block_size=4,
                                       num_hidden_layers=1, selector_rank=2, selector_top_k=2)
    model = DFlash2DraftModel(config)
    model.candidate_selector = _hand_selector()
    head = nn.Linear(2, 4, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[2.0, 0.0], [1.0, 0.0], [0.0, 0.0], [-1.0, 0.0]]))
    return model, head


def test_selector_loss_golden_numbers():
    model, head = _hand_loss_model()
    h = torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]])  # unary top-2: tokens 0 (U=2) and 1 (U=1)
    pred = torch.tensor([0, 1, 0])  # row 1's predecessor adds <(1, -1) * (1, 0), B[c]> = B[c][0]: 1 for token 0
    gold = torch.tensor([1, 1, 3])  # row 2's gold is outside the top-2: no selector term
    weights = torch.tensor([0.5, 1.0, 1.0])
    unary, cand = head(h).topk(2, dim=-1)
    assert cand.tolist() == [[0, 1]] * 3
    total, hits = model.selector_loss(h, pred, gold, cand, unary, weights)
    loss = float(total.detach())
    ce0 = math.log(math.exp(2) + math.exp(1)) - 1  # scores (2, 1), gold index 1
    ce1 = math.log(math.exp(3) + math.exp(1)) - 1  # scores (2 + 1, 1 + 0)
    assert loss == pytest.approx(0.5 * ce0 + ce1, rel=1e-6)
    assert hits.tolist() == [False, False, False]
    total.backward()
    assert model.candidate_selector.successor_codebook.grad[0].abs().sum() > 0


def test_selector_term_reads_the_teacher_forced_predecessor():
    model, head = _hand_loss_model()
    # one block of 4 at anchor 2: slot k predicts x[2 + k]
    input_ids = torch.tensor([[3, 3, 1, 0, 1, 3]])
    labels = torch.tensor([[-100, 0, 1, -100]])  # slots 1, 2 supervised (slot 3 is outside the answer)
    hidden = torch.tensor([[[0.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 0.0]]])
    weights = torch.tensor([0.0, 1.0, 0.5, 0.25])
    candidates = dflash_loss(hidden, labels, head, weights, chunk_size=8, top_k=2).candidates
    assert candidates.weights.tolist() == [1.0, 0.5]  # the slot weights of slots 1 and 2
    got, correct, _ = selector_term(model, hidden, labels, input_ids, torch.tensor([[2]]), head, candidates)
    # slot 1: predecessor x[2] = 1, gold 0; slot 2: predecessor x[3] = 0, gold 1
    unary, cand = head(hidden[0, 1:3]).topk(2, dim=-1)
    expected, hits = model.selector_loss(hidden[0, 1:3], torch.tensor([1, 0]), torch.tensor([0, 1]), cand, unary,
                                         weights[1:3])
    assert float(got.detach()) == float(expected.detach())
    assert correct.tolist() == [0.0, *hits.float().tolist(), 0.0]  # per slot of the block


@torch.inference_mode()
def test_fresh_selector_walk_is_the_unary_argmax():
    # A zero successor codebook adds nothing: a fresh drafter drafts DFlash's argmax tokens.
    from dflash_train.model.dflash import ContextCache, target_features

    target = make_tiny_target("qwen3", layers=4, seed=3)
    drafter = _drafter(target, randomise=False, num_hidden_layers=1, target_layer_ids=[1, 2])
    ids = torch.randint(0, 90, (1, 7), generator=torch.Generator().manual_seed(2))
    feats = target_features(target(ids, output_hidden_states=True).hidden_states, drafter.target_layer_ids)
    block = torch.full((1, 4), MASK_ID)
    block[0, 0] = 42
    drafts, _ = drafter.propose(target, 42, 3, 4, feats, 7, ContextCache(), MASK_ID, Sampling(), None)
    assert drafts.tolist() == drafter.draft(target, block, feats, 7, ContextCache())[0].argmax(-1).tolist()


# ------------------------------------------------------------------------------ training
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_inputs(tmp_path_factory.mktemp("dflash2"))


def _cfg(tiny, out, drafter=None, **kw):
    # A random drafter ranks the gold token far down a 49K vocabulary: a wide top-K lets some
    # slots cover it, so the selector gets a gradient from the first steps.
    drafter = {"kind": "dflash2", "dflash2": {"selector_rank": 8, "selector_top_k": 2048}, **(drafter or {})}
    return tiny_train_config(tiny["target"], tiny["data"], out, drafter=drafter, **kw)


def test_dflash2_trains_and_resumes_to_the_same_weights(tiny, tmp_path):
    straight = Trainer(_cfg(tiny, tmp_path / "a", max_steps=4))
    assert isinstance(straight.drafter, DFlash2DraftModel)
    straight.fit()
    first = Trainer(_cfg(tiny, tmp_path / "b", max_steps=2))
    first.fit()
    resumed = Trainer(_cfg(tiny, tmp_path / "b", max_steps=4))
    resumed.resume()
    assert resumed.state.step == 2
    resumed.fit()
    after = resumed.drafter.state_dict()
    for k, v in straight.drafter.state_dict().items():
        assert torch.equal(v, after[k]), k
    # every DFlash2 module learned something
    fresh = Trainer(_cfg(tiny, tmp_path / "c", max_steps=1)).drafter.state_dict()
    for k in ("layers.0.attention_conv.kernel_projection.weight", "layers.0.mlp_conv.base_kernel",
              "candidate_selector.successor_codebook", "candidate_selector.hidden_projection.weight"):
        assert not torch.equal(after[k], fresh[k]), k


def test_without_its_selector_term_dflash2_starts_exactly_as_dflash(tiny, tmp_path):
    """Same seed, same data: the DFlash2 backbone is DFlash's, its identity convolutions pass
    every value and gradient through unchanged, so with selector_loss_weight 0 the first step's
    loss and every trunk gradient are DFlash's bit for bit; the selector term changes both."""
    runs = {name: Trainer(tiny_train_config(tiny["target"], tiny["data"], tmp_path / name, max_steps=1,
                                            drafter=drafter))
            for name, drafter in [("dflash", {"kind": "dflash"}),
                                  ("off", {"kind": "dflash2", "dflash2": {"selector_top_k": 2048,
                                                                          "selector_loss_weight": 0.0}}),
                                  ("on", {"kind": "dflash2", "dflash2": {"selector_top_k": 2048}})]}
    results = {}
    for name, tr in runs.items():
        out = tr.micro_step(tr.micro_batches(0)[0])
        out.weighted_sum.backward()
        results[name] = (out.weighted_sum.detach(), {k: p.grad for k, p in tr.drafter.named_parameters()})
    loss, grads = results["dflash"]
    for k, v in runs["dflash"].drafter.state_dict().items():
        assert torch.equal(v, runs["off"].drafter.state_dict()[k]), k
    assert torch.equal(results["off"][0], loss)
    for k, g in grads.items():
        assert torch.equal(results["off"][1][k], g), k
    assert results["on"][0] > loss  # some slots have their gold among the 2048 candidates
    assert not torch.equal(results["on"][1]["fc.weight"], grads["fc.weight"])


def test_the_selector_term_shares_the_dpace_weights_of_the_unary_ce():
    model, head = _hand_loss_model()
    input_ids = torch.tensor([[3, 3, 1, 0, 1, 3]])
    labels = torch.tensor([[-100, 0, 1, 3]])
    hidden = torch.tensor([[[0.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.5, 0.0]]])
    slot_weights = torch.tensor([0.0, 1.0, 0.5, 0.25])
    out = dflash_loss(hidden, labels, head, slot_weights, chunk_size=8, top_k=2, dpace_alpha=0.5)
    ce = nn.functional.cross_entropy(head(hidden[0, 1:]), labels[0, 1:], reduction="none")
    q = 0.5 * torch.exp(-ce) + 0.5  # D-PACE's smoothed confidences of slots 1..3
    reach = q.cumprod(0)
    want = reach.flip(0).cumsum(0).flip(0)  # w_j = sum_{m >= j} prod_{i <= m} q_i
    torch.testing.assert_close(out.candidates.weights, want, rtol=1e-6, atol=0)
    got, _, _ = selector_term(model, hidden, labels, input_ids, torch.tensor([[2]]), head, out.candidates)
    unary, cand = head(hidden[0, 1:]).topk(2, dim=-1)
    expected, _ = model.selector_loss(hidden[0, 1:], torch.tensor([1, 0, 1]), labels[0, 1:], cand, unary, want)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)


class _Head:
    """What ``pick_drafts`` reads of a target: its output embeddings."""

    def __init__(self, head):
        self.head = head

    def get_output_embeddings(self):
        return self.head


@torch.no_grad()
def test_a_dflash2_drafters_accuracies_are_its_walks_acceptance():
    """The trainer's per-slot hits of a DFlash2 drafter are the selector walk's picks after the
    gold predecessor, as ``pick_drafts`` (every runtime's pick) makes them; and in every block
    the leading run of those hits is the run of drafts greedy decoding accepts from the walk
    itself: expected tau measures what the drafter proposes, not its unary argmax."""
    block, blocks, seq, top_k = 4, 3, 20, 4
    config = DFlash2Config.from_target(make_tiny_target("qwen3", layers=4, seed=3).config, mask_token_id=MASK_ID,
                                       num_hidden_layers=1, block_size=block, selector_rank=8, selector_top_k=top_k)
    torch.manual_seed(1)
    model = DFlash2DraftModel(config)
    for p in model.candidate_selector.parameters():
        p.normal_(0, 0.5)
    head = nn.Linear(64, 97, bias=False)
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(1, blocks * block, 64, generator=gen)
    # Labels drawn among each slot's unary top-K, written into the sequence they come from.
    anchors = torch.tensor([[1, 6, 12]])
    input_ids = torch.randint(0, 97, (1, seq), generator=gen)
    top = head(hidden[0]).topk(top_k, dim=-1).indices  # (12, K)
    labels = torch.full((1, blocks * block), -100)
    for n, p in enumerate(anchors[0].tolist()):
        for k in range(1, block):
            q = n * block + k
            labels[0, q] = input_ids[0, p + k] = top[q, torch.randint(0, top_k, (1,), generator=gen)]
    out = dflash_loss(hidden, labels, head, torch.tensor([0.0, 1.0, 0.7, 0.4]), 8, top_k=top_k)
    _, correct, _ = selector_term(model, hidden, labels, input_ids, anchors, head, out.candidates)

    shim, expected, runs = _Head(head), torch.zeros(block), []
    for n, p in enumerate(anchors[0].tolist()):
        h = hidden[:, n * block:(n + 1) * block]  # (1, B, H): slot 0 the anchor's
        gold = labels[0, n * block + 1:(n + 1) * block]
        hits = []
        for k in range(1, block):  # one walk step from the gold predecessor x[p + k - 1]
            pick, _ = model.pick_drafts(shim, h[:, [0, k]], input_ids[0, p + k - 1:p + k], 1, Sampling(), None)
            hits.append(bool(pick[0, 0] == gold[k - 1]))
            expected[k] += hits[-1]
        drafts, _ = model.pick_drafts(shim, h, input_ids[0, p:p + 1], block - 1, Sampling(), None)
        accepted = int((drafts[0] == gold).long().cumprod(0).sum())
        assert accepted == int(torch.tensor(hits).long().cumprod(0).sum())
        runs.append(accepted)
    assert torch.equal(correct, expected)
    assert correct.sum() > 0 and not torch.equal(correct, out.correct)  # the walk is not the argmax here


def test_unknown_kind_is_a_one_line_error(tiny, tmp_path):
    with pytest.raises(ValueError, match=r"drafter.kind='dflash3'"):
        tiny_train_config(tiny["target"], tiny["data"], tmp_path, drafter={"kind": "dflash3"})


# ------------------------------------------------------------------------------ runtime
@torch.inference_mode()
def test_greedy_walk_follows_the_pair_scores_from_the_anchor():
    target = make_tiny_target("qwen3", layers=4, seed=3)
    drafter = _drafter(target, num_hidden_layers=1, target_layer_ids=[1, 2])
    from dflash_train.model.dflash import ContextCache, target_features

    ids = torch.randint(0, 90, (1, 7), generator=torch.Generator().manual_seed(2))
    out = target(ids, output_hidden_states=True)
    feats = target_features(out.hidden_states, drafter.target_layer_ids)
    block = torch.full((1, 4), MASK_ID)
    block[0, 0] = 42
    drafts, probs = drafter.propose(target, 42, 3, 4, feats, 7, ContextCache(), MASK_ID, Sampling(), None)
    assert probs is None
    hidden = drafter.draft_hidden(target, block, feats, 7, ContextCache())[0, 1:]  # (3, H)
    unary, cand = target.get_output_embeddings()(hidden).topk(4, dim=-1)
    sel = drafter.candidate_selector
    pred, walked = 42, []
    for j in range(3):  # the walk written out with the codebooks' rows
        pair = ((sel.predecessor_codebook[pred] * sel.hidden_projection(hidden[j])) * sel.successor_codebook[cand[j]])
        pred = int(cand[j, (unary[j] + pair.sum(-1)).argmax()])
        walked.append(pred)
    assert drafts.tolist() == walked
    assert walked != cand[:, 0].tolist()  # the pair scores changed the path: the check has power


@torch.inference_mode()
def test_sampled_drafts_come_from_the_scattered_candidate_distribution():
    target = make_tiny_target("qwen3", layers=4, seed=3)
    drafter = _drafter(target, num_hidden_layers=1, target_layer_ids=[1, 2])
    from dflash_train.model.dflash import ContextCache, target_features

    ids = torch.randint(0, 90, (1, 7), generator=torch.Generator().manual_seed(2))
    feats = target_features(target(ids, output_hidden_states=True).hidden_states, drafter.target_layer_ids)
    block = torch.full((1, 4), MASK_ID)
    block[0, 0] = 42
    drafts, probs = drafter.propose(target, 42, 3, 4, feats, 7, ContextCache(), MASK_ID, Sampling(temperature=0.7),
                                    torch.Generator().manual_seed(0))
    unary, cand = target.get_output_embeddings()(drafter.draft_hidden(target, block, feats, 7, ContextCache())[0, 1:]
                                                 ).topk(4, dim=-1)
    assert torch.allclose(probs.sum(-1), torch.ones(3))
    for j in range(3):
        support = set(probs[j].nonzero().flatten().tolist())
        assert support <= set(cand[j].tolist()) and int(drafts[j]) in support


def test_greedy_speculation_is_lossless_on_tiny_targets():
    for arch in ("llama", "qwen3"):
        target = make_tiny_target(arch)
        drafter = _drafter(target, block_size=5)
        ids = torch.randint(0, 90, (1, 7), generator=torch.Generator().manual_seed(2))
        for new in (1, 2, 9, 23):
            out = drafter.spec_generate(target, ids, new, return_stats=True)
            assert torch.equal(out.output_ids, target.generate(ids, max_new_tokens=new, do_sample=False))
            assert out.num_new_tokens == new and sum(out.acceptance_lengths) == new - 1


def test_bundled_runtime_is_lossless_with_the_real_small_target(smollm2, smollm2_tokenizer):
    """runtime.spec_generate (what dflash-eval calls) with a DFlash2 drafter on SmolLM2-135M:
    the greedy output is the target's own greedy output, token for token (float32, CPU), in
    the dynamic and the static runtime, which accept the same drafts at every step."""
    from dflash_train.model.runtime import spec_generate
    from tests.conftest import SMOLLM2_MASK_ID

    config = DFlash2Config.from_target(smollm2.config, mask_token_id=SMOLLM2_MASK_ID, num_hidden_layers=1,
                                       block_size=4, target_layer_ids=[2, 6], selector_rank=16)
    torch.manual_seed(0)
    drafter = DFlash2DraftModel(config).eval()
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "conv" in name or "selector" in name:
                p.normal_(0, 0.3)
    text = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": "Count from one to ten."}],
                                                 tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([smollm2_tokenizer(text, add_special_tokens=False)["input_ids"]])
    plain = smollm2.model.generate(ids, max_new_tokens=24, do_sample=False)
    out = spec_generate(drafter, smollm2.model, ids, 24, return_stats=True, static=False)
    static = spec_generate(drafter, smollm2.model, ids, 24, return_stats=True, static=True)
    assert torch.equal(out.output_ids, plain) and torch.equal(static.output_ids, plain)
    assert out.num_new_tokens == 24 and static.acceptance_lengths == out.acceptance_lengths


def test_init_from_a_drafter_of_another_kind_is_a_one_line_error(tiny, tmp_path):
    plain = Trainer(tiny_train_config(tiny["target"], tiny["data"], tmp_path / "plain", max_steps=1, export=True))
    plain.fit()
    with pytest.raises(ValueError, match=r"the checkpoint is a dflash drafter but this run builds a dflash2 one "
                                         r"\(drafter.kind\); set drafter.kind=dflash"):
        Trainer(_cfg(tiny, tmp_path / "two", max_steps=1, drafter={"init_from": str(tmp_path / "plain" / "export")}))


@torch.inference_mode()
def test_the_inference_forward_equals_the_training_forward_of_the_same_block():
    """A draft step over a context cache gives the hidden states the training layout gives
    the block at that anchor (convolutions included): one model, two paths."""
    from dflash_train.model.dflash import ContextCache, target_features

    target = make_tiny_target("qwen3", layers=4, seed=3)
    drafter = _drafter(target, num_hidden_layers=2, target_layer_ids=[1, 2])
    t, anchor = 12, 7
    seq = torch.randint(0, 90, (t,), generator=torch.Generator().manual_seed(5))
    feats = target_features(target(seq[None], output_hidden_states=True).hidden_states, drafter.target_layer_ids)
    anchors = torch.tensor([[3, anchor]])
    blocks = block_input_ids(seq, anchors[0], 4, MASK_ID).flatten()[None]  # (1, 8)
    positions = torch.cat([torch.arange(t), block_position_ids(torch.arange(t), anchors[0], 4).flatten()])[None]
    training = drafter(target.get_input_embeddings()(blocks), feats, positions,
                       {FULL_ATTENTION: visible_mask(anchors, t, 4)})[:, 4:]  # the block at `anchor`
    cache = ContextCache()
    inference = drafter.draft_hidden(target, blocks[:, 4:], feats[:, :anchor], anchor, cache)
    assert torch.allclose(inference, training, atol=1e-5)
