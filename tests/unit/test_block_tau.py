"""tau counted block by block (``tau`` / ``val_tau``): each block accepts its leading run of
correct drafts, stopping at the first miss or unsupervised slot, for every drafter kind.

Golden numbers on constructed predictions: a one-hot head makes each slot's prediction a
chosen token (DFlash), a Markov head that always predicts "the previous token + 1" makes
DSpark's depend on the gold token before it, and a selector that prefers a token after a
given predecessor makes DFlash2's walk differ from the unary argmax. Then the real trainer
on the tiny target against a plain loop over blocks, for each kind.
"""

import itertools
import math

import pytest
import torch
from torch import nn

from dflash_train import contract
from dflash_train.contract import IGNORE_INDEX as IGN
from dflash_train.model.dflash2 import CandidateSelector, DFlash2Config, DFlash2DraftModel
from dflash_train.model.dspark import DSparkConfig, DSparkDraftModel
from dflash_train.training.dspark_loss import DSparkLossWeights, dspark_loss
from dflash_train.training.loss import Distillation, dflash_loss, selector_term
from dflash_train.training.trainer import Trainer
from tests.conftest import make_tiny_target
from tests.train_data import tiny_inputs, tiny_train_config

pytestmark = pytest.mark.usefixtures("one_thread")

B, V = 4, 8  # block size; vocabulary = hidden size of the one-hot head
WALKS = [pytest.param({}, id="plain"), pytest.param(dict(fused=True, compiled=False), id="fused")]


def test_accepted_prefix_is_the_leading_run_of_hits():
    hits = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    assert contract.accepted_prefix(hits).tolist() == [2, 0, 4, 0]
    assert contract.acceptance_length(4, 6) == 2.5
    assert math.isnan(contract.acceptance_length(0, 0))


def _one_hot_head() -> nn.Linear:
    head = nn.Linear(V, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.eye(V))
    return head.requires_grad_(False)


def _predicting(tokens: list[list[int]]) -> torch.Tensor:
    """(b, Q, V) drafter outputs whose argmax under the one-hot head is ``tokens`` (b, Q)."""
    return nn.functional.one_hot(torch.tensor(tokens), V).float() * 5.0


# Two rows of three blocks (anchor slot 0 never supervised): row 0 all right, a miss at slot
# 2 (slot 3 right after it counts nothing), an unsupervised slot 2 (slot 3 right after it
# counts nothing); row 1 a partial last block (slot 3 past the row), a miss at slot 1, and a
# padding block with no supervised slot (not a block of the loss).
DFLASH_LABELS = [[IGN, 1, 2, 3, IGN, 1, 2, 3, IGN, 1, IGN, 3],
                 [IGN, 4, 5, IGN, IGN, 2, 6, 7, IGN, IGN, IGN, IGN]]
DFLASH_PREDS = [[0, 1, 2, 3, 0, 1, 5, 3, 0, 1, 2, 3],
                [0, 4, 5, 6, 0, 3, 6, 7, 0, 0, 0, 0]]


@pytest.mark.parametrize("options", WALKS)
def test_dflash_blocks_accept_their_leading_correct_slots(options):
    out = dflash_loss(_predicting(DFLASH_PREDS), torch.tensor(DFLASH_LABELS), _one_hot_head(),
                      contract.slot_weights(B, 2.0), chunk_size=3, **options)
    assert out.blocks.item() == 5  # the padding block is not one
    assert out.accepted.item() == 3 + 1 + 1 + 2 + 0
    assert contract.acceptance_length(out.blocks.item(), out.accepted.item()) == 1 + 7 / 5


def test_dflash_acceptance_is_the_same_under_dpace_and_distillation():
    hidden, labels = _predicting(DFLASH_PREDS), torch.tensor(DFLASH_LABELS)
    teacher = torch.randn(2, 16, V, generator=torch.Generator().manual_seed(0))  # (b, T, H)
    distill = Distillation(teacher, torch.tensor([[0, 4, 8], [0, 4, 8]]), weight=0.5)
    for options in (dict(dpace_alpha=0.3), dict(distill=distill)):
        out = dflash_loss(hidden, labels, _one_hot_head(), contract.slot_weights(B, 2.0), 3, **options)
        assert (out.blocks.item(), out.accepted.item()) == (5, 7)


def test_exact_tau_equals_expected_tau_when_slots_are_independent_by_construction():
    # Every combination of per-slot outcomes with accuracies 3/4, 1/2, 1/4: 4 * 2 * 4 = 32
    # blocks whose joint hits are exactly the product of the marginals.
    outcomes = [[1, 1, 1, 0], [1, 0], [1, 0, 0, 0]]
    blocks = list(itertools.product(*outcomes))
    labels = [[IGN, 1, 2, 3] * len(blocks)]
    preds = [[t for block in blocks for t in (0, *(k + 1 if hit else 0 for k, hit in enumerate(block)))]]
    out = dflash_loss(_predicting(preds), torch.tensor(labels), _one_hot_head(), contract.slot_weights(B, 2.0), 7)
    acc = torch.tensor([float(c / n) for c, n in zip(out.correct[1:], out.count[1:])])
    assert acc.tolist() == [0.75, 0.5, 0.25]
    expected = contract.expected_acceptance_length(acc)
    assert expected == 1 + 0.75 + 0.75 * 0.5 + 0.75 * 0.5 * 0.25
    assert contract.acceptance_length(out.blocks.item(), out.accepted.item()) == pytest.approx(expected, abs=1e-12)


def test_correlated_slots_make_the_expected_tau_wrong_and_the_exact_one_right():
    # Two blocks: one all right, one all wrong. Accuracy 1/2 at every slot gives expected tau
    # 1 + 1/2 + 1/4 + 1/8, but the blocks accept 3 and 0 drafts: tau 2.5.
    labels = [[IGN, 1, 2, 3, IGN, 1, 2, 3]]
    preds = [[0, 1, 2, 3, 0, 0, 0, 0]]
    out = dflash_loss(_predicting(preds), torch.tensor(labels), _one_hot_head(), contract.slot_weights(B, 2.0), 8)
    assert contract.acceptance_length(out.blocks.item(), out.accepted.item()) == 2.5
    assert (out.correct[1:] / out.count[1:]).tolist() == [0.5, 0.5, 0.5]
    assert contract.expected_acceptance_length(out.correct[1:] / out.count[1:]) == 1.875


# ------------------------------------------------------------------------------- DSpark
def _successor_dspark() -> DSparkDraftModel:
    """A DSpark drafter whose Markov term adds 10 to token (prev + 1) % V: with zero drafter
    outputs every slot predicts the token after the one before it."""
    config = DSparkConfig(hidden_size=V, intermediate_size=16, num_attention_heads=1, num_key_value_heads=1,
                          head_dim=V, vocab_size=V, num_hidden_layers=1, num_target_layers=2, block_size=B,
                          markov_rank=V, dflash_config={"mask_token_id": 0, "target_layer_ids": [0]})
    drafter = DSparkDraftModel(config)
    with torch.no_grad():
        drafter.markov_head.markov_w1.weight.copy_(torch.eye(V))
        drafter.markov_head.markov_w2.weight.copy_(10.0 * torch.eye(V).roll(1, dims=0))  # column prev -> row prev + 1
    return drafter


@pytest.mark.parametrize("options", WALKS)
def test_dspark_slots_are_scored_after_the_gold_previous_token(options):
    ids = torch.tensor([[3, 4, 5, 6, 0, 1, 2, 2, 3, 4],
                        [1, 2, 3, 4, 5, 6, 7, 0, 1, 2]])
    loss_mask = torch.tensor([[1] * 10, [1, 1, 1, 0, 1, 1, 1, 1, 1, 1]])
    anchors = torch.tensor([[0, 4, 7], [0, 4, 5]])
    labels = torch.stack([contract.dspark_block_labels(ids[r], loss_mask[r], anchors[r], B).flatten()
                          for r in range(2)])  # (2, N * B)
    # row 0: labels 4 5 6 0 (3 accepted: after the gold 6 comes 7), 1 2 2 3 (2: slot 3 is
    # right after the gold 2 but follows a miss), 3 4 - - (a partial last block: 2);
    # row 1: 2 3 - - (cut where loss_mask is 0: 2), 6 7 0 1 (4), 7 0 1 2 (4)
    assert labels[0].tolist() == [4, 5, 6, 0, 1, 2, 2, 3, 3, 4, IGN, IGN]
    assert labels[1].tolist() == [2, 3, IGN, IGN, 6, 7, 0, 1, 7, 0, 1, 2]
    block_ids = torch.zeros(2, 3 * B, dtype=torch.long)
    block_ids[:, ::B] = ids.gather(1, anchors)
    drafter = _successor_dspark()
    out = dspark_loss(drafter, torch.zeros(2, 3 * B, V), labels, block_ids, anchors, torch.zeros(2, 10, V),
                      _one_hot_head(), contract.slot_weights(B, 2.0, "dspark"), 5, DSparkLossWeights(), **options)
    assert out.blocks.item() == 6
    assert out.accepted.item() == 3 + 2 + 2 + 2 + 4 + 4


# ------------------------------------------------------------------------------ DFlash2
def _preferring_dflash2() -> tuple[DFlash2DraftModel, nn.Linear]:
    """A DFlash2 drafter at top-K 2 whose selector adds 5 to token 1 after predecessor 1 (and
    nothing after any other), and a head with logits h0 * (2, 1, 0, -1): the unary argmax is
    token 0, the walk picks 1 after a 1."""
    config = DFlash2Config.from_target(make_tiny_target().config, mask_token_id=96, block_size=B,
                                       num_hidden_layers=1, selector_rank=2, selector_top_k=2)
    model = DFlash2DraftModel(config)
    model.candidate_selector = CandidateSelector(hidden_size=2, vocab_size=4, rank=2)
    with torch.no_grad():
        model.candidate_selector.hidden_projection.weight.copy_(torch.eye(2))
        model.candidate_selector.predecessor_codebook.zero_()
        model.candidate_selector.predecessor_codebook[1] = torch.tensor([1.0, 0.0])
        model.candidate_selector.successor_codebook.zero_()
        model.candidate_selector.successor_codebook[1] = torch.tensor([5.0, 0.0])
    head = nn.Linear(2, 4, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[2.0, 0.0], [1.0, 0.0], [0.0, 0.0], [-1.0, 0.0]]))
    return model, head.requires_grad_(False)


def test_dflash2_accepts_the_selector_walks_picks_after_the_gold_predecessor():
    model, head = _preferring_dflash2()
    # Two blocks at anchors 0 and 4 of one row; slot k predicts x[p + k] after x[p + k - 1].
    input_ids = torch.tensor([[1, 1, 1, 0, 0, 1, 1, 2]])
    anchors = torch.tensor([[0, 4]])
    # block 0: after 1, 1, 1 the walk picks 1, 1, 1: labels 1 1 0 accept 2 (the unary argmax, 0, none);
    # block 1: after 0 the walk picks 0 (label 1: a miss), so 0 accepted.
    labels = torch.tensor([[IGN, 1, 1, 0, IGN, 1, 1, 2]])
    hidden = torch.zeros(1, 2 * B, 2)
    hidden[..., 0] = 1.0
    weights = contract.slot_weights(B, 2.0)
    out = dflash_loss(hidden, labels, head, weights, chunk_size=3, top_k=2)
    assert (out.blocks.item(), out.accepted.item()) == (2, 0)  # the unary argmax is 0 everywhere
    _total, _correct, accepted = selector_term(model, hidden, labels, input_ids, anchors, head, out.candidates)
    assert accepted.item() == 2


# ------------------------------------------------------------------------- the trainer
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_inputs(tmp_path_factory.mktemp("block_tau"))


KINDS = {"dflash": {}, "dspark": {"markov_rank": 16},
         "dflash2": {"dflash2": {"selector_rank": 8, "selector_top_k": 8}}}


def _reference(trainer, batch, hidden) -> tuple[int, int]:
    """(blocks, accepted drafts) by a plain loop over blocks and slots: each slot's greedy pick
    after the gold token before it (DSpark's Markov logits, DFlash2's selector over the unary
    top-K, DFlash's argmax), counted up to the first miss or unsupervised slot."""
    kind, drafter, head = trainer.cfg.drafter.kind, trainer.drafter, trainer.target.lm_head
    size = drafter.block_size
    first = 0 if kind == "dspark" else 1  # DSpark's slot k predicts x[p + k + 1], DFlash's x[p + k]
    blocks = accepted = 0
    for r, n in itertools.product(range(batch.labels.shape[0]), range(batch.anchors.shape[1])):
        labels = batch.labels[r, n * size:(n + 1) * size]
        if (labels == IGN).all():
            continue
        blocks += 1
        for k in range(first, size):
            if labels[k] == IGN:
                break
            h = hidden[r, n * size + k]
            prev = batch.input_ids[r, batch.anchors[r, n] + k - first]  # the gold token before the label
            logits = head(h.to(head.weight.dtype)).float()
            if kind == "dspark":
                pick = drafter.markov_logits(logits, prev).argmax()
            elif kind == "dflash2":
                unary, cand = logits.topk(drafter.selector_top_k)
                score = unary + drafter.candidate_selector(h[None], prev[None], cand[None])[0]
                pick = cand[score.argmax()]
            else:
                pick = logits.argmax()
            if pick != labels[k]:
                break
            accepted += 1
    return blocks, accepted


@pytest.mark.parametrize("kind", list(KINDS))
@torch.no_grad()
def test_the_trainers_count_equals_a_plain_loop_over_blocks(kind, tiny, tmp_path):
    trainer = Trainer(tiny_train_config(tiny["target"], tiny["data"], tmp_path, drafter={"kind": kind, **KINDS[kind]}))
    if kind == "dflash2":  # a fresh selector adds nothing; make its walk differ from the argmax at times
        for p in trainer.drafter.candidate_selector.parameters():
            p.normal_(0, 0.2, generator=torch.Generator().manual_seed(1))
    batch = trainer.micro_batches(0)[0]
    feats, noise, final = trainer.target_inputs(batch)
    hidden = trainer.draft(batch, feats, noise, trainer.masks(batch))
    # A random drafter hits nothing: steer two slots in three towards their labels.
    labels = batch.labels.clamp(min=0)
    steer = (torch.arange(labels.shape[1]) % 3 != 0) & (batch.labels != IGN)
    hidden = torch.where(steer[..., None], trainer.target.lm_head.weight[labels].to(hidden.dtype), hidden)
    out = trainer.loss(batch, hidden, final)
    blocks, accepted = _reference(trainer, batch, hidden)
    assert accepted > blocks // 2  # the steered slots make runs of several drafts
    assert (out.blocks.item(), out.accepted.item()) == (blocks, accepted)
    if kind == "dflash2":  # what counts is the walk's picks, and here they differ from the argmax's
        unary = dflash_loss(hidden, batch.labels, trainer.target.lm_head, trainer.slot_weights, 64)
        assert unary.accepted.item() > accepted
