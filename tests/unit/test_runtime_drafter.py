"""The drafter's side of the runtime (contract section 3).

Greedy output equals the target's whatever the drafter proposes, so losslessness alone
cannot catch a runtime that feeds the drafter the wrong context. These tests look at the
drafts themselves: every step's draft logits against a from-scratch training-layout
forward over the committed sequence, and per-step acceptance lengths against the
reference `dflash` runtime for a drafter that really is accepted (tau well above 1).
"""

import pytest
import torch
import torch.nn.functional as F

from dflash_train.contract import IGNORE_INDEX, block_input_ids, block_labels, block_position_ids
from dflash_train.model.dflash import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    DFlashConfig,
    DFlashDraftModel,
    visible_mask,
)
from dflash_train.model.io import save_drafter
from dflash_train.model.target import TargetModel
from tests.conftest import make_tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 4
PROMPT_LEN = 6
NEW_TOKENS = 32
MASK_ID = 96  # the tiny target's last row; its greedy outputs never need it as a token
TRAIN_STEPS = 50
# from-scratch and incremental float32 forwards of the same drafts differ by ~1e-6
LOGIT_ATOL = 1e-4


@pytest.fixture(scope="module")
def target():
    return make_tiny_target("qwen3", layers=4, seed=3)


@pytest.fixture(scope="module")
def prompts():
    return torch.randint(0, 90, (4, PROMPT_LEN), generator=torch.Generator().manual_seed(4))


def tiny_drafter(target, seed, **overrides):
    cfg = DFlashConfig.from_target(target.config, mask_token_id=MASK_ID, num_hidden_layers=overrides.pop("layers", 1),
                                   block_size=overrides.pop("block_size", BLOCK), **overrides)
    torch.manual_seed(seed)
    return DFlashDraftModel(cfg).eval()


def training_logits(target, drafter, seqs, anchors, width):
    """`training_hidden` read by the target's head: (b, N*width, V)."""
    return target.get_output_embeddings()(training_hidden(target, drafter, seqs, anchors, width))


def training_hidden(target, drafter, seqs, anchors, width):
    """The drafter's outputs (b, N*width, H) in the training layout for blocks of ``width`` at
    ``anchors`` (b, N): [T context features | N blocks] under one dense visibility mask.

    Built here from the contract's functions and the target's features (decoder-layer
    hooks), sharing nothing with the runtime but the drafter's forward.
    """
    b, t = seqs.shape
    feats = TargetModel(target).features(seqs, drafter.target_layer_ids)  # (b, T, n*H)
    blocks = torch.stack([block_input_ids(s, a, width, drafter.mask_token_id) for s, a in zip(seqs, anchors)])
    slots = torch.stack([block_position_ids(torch.arange(t), a, width) for a in anchors])  # (b, N, width)
    positions = torch.cat([torch.arange(t).expand(b, -1), slots.flatten(1)], 1)  # (b, T + N*width)
    masks = {FULL_ATTENTION: visible_mask(anchors, t, width)}
    if SLIDING_ATTENTION in drafter.layer_types:
        masks[SLIDING_ATTENTION] = visible_mask(anchors, t, width, sliding_window=drafter.config.sliding_window,
                                                causal_block=True)
    noise = target.get_input_embeddings()(blocks.flatten(1))  # (b, N*width, H)
    return drafter(noise, feats, positions, masks)


@pytest.fixture(scope="module")
def trained(target, prompts):
    """A drafter half-way to memorising the target's greedy continuations of ``prompts``.

    A runtime test needs acceptance well above 1 and steps of every length, cheaply: 30
    full-batch steps on 4 short answers take about a second on CPU and give tau about 2.4
    (100 steps give 3.7, nearly every block whole, and fewer decisions near a boundary).
    """
    return train_drafter(target, prompts, BLOCK, TRAIN_STEPS)


def train_drafter(target, prompts, block: int, steps: int, drafter=None, loss=None):
    """A drafter trained ``steps`` full-batch steps on the target's greedy answers to
    ``prompts`` (every answer position an anchor): ``drafter`` (default a fresh DFlash one of
    ``block`` slots) under ``loss(drafter, seqs, anchors, loss_mask)`` (default DFlash's CE)."""
    with torch.no_grad():
        seqs = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=NEW_TOKENS,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
    drafter = (tiny_drafter(target, seed=5, block_size=block) if drafter is None else drafter).train()
    for p in target.parameters():
        p.requires_grad_(False)
    anchors = torch.arange(PROMPT_LEN - 1, seqs.shape[1] - 1).expand(len(seqs), -1)  # every answer position
    loss_mask = (torch.arange(seqs.shape[1]) >= PROMPT_LEN).long()
    if loss is None:
        labels = torch.stack([block_labels(s, loss_mask, a, block) for s, a in zip(seqs, anchors)]).flatten(1)

        def loss(drafter, seqs, anchors, loss_mask):
            logits = training_logits(target, drafter, seqs, anchors, block)
            return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    for _ in range(steps):
        value = loss(drafter, seqs, anchors, loss_mask)
        opt.zero_grad()
        value.backward()
        opt.step()
    for p in target.parameters():
        p.requires_grad_(True)
    return drafter.eval()


def record_drafts(monkeypatch, drafter) -> list[dict]:
    """Each draft step's anchor position, block, logits (slots 1..W-1, through the target's
    head) and drafter cache length."""
    steps = []
    draft_hidden = drafter.draft_hidden

    def recording(target, block_ids, new_features, start, cache):
        hidden = draft_hidden(target, block_ids, new_features, start, cache)
        steps.append({"start": start, "width": block_ids.shape[1],
                      "logits": target.get_output_embeddings()(hidden[0, 1:]).clone(),
                      "cache": cache.keys[0].shape[-2] if cache.keys else 0})
        return hidden

    monkeypatch.setattr(drafter, "draft_hidden", recording)
    return steps


def check_drafts_against_training_layout(target, drafter, steps, output_ids):
    committed = output_ids[0]
    with torch.no_grad():
        for width in {s["width"] for s in steps}:
            group = [s for s in steps if s["width"] == width]
            anchors = torch.tensor([[s["start"] for s in group]])
            expected = training_logits(target, drafter, output_ids, anchors, width)[0].view(len(group), width, -1)
            for j, s in enumerate(group):
                # the drafter's context is exactly the committed tokens before the anchor
                assert s["cache"] == s["start"] < committed.numel()
                torch.testing.assert_close(s["logits"], expected[j, 1:], atol=LOGIT_ATOL, rtol=1e-4,
                                           msg=lambda m, s=s: f"draft step at start={s['start']}: {m}")


DRAFTERS = {
    "trained": None,  # steps of every length
    "sliding": {"layers": 2, "layer_types": [SLIDING_ATTENTION, FULL_ATTENTION], "sliding_window": 5,
                "use_sliding_window": True, "initializer_range": 0.2},
}


@pytest.mark.parametrize("which", list(DRAFTERS))
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_every_draft_step_equals_the_training_forward_over_the_committed_sequence(
        monkeypatch, target, prompts, trained, which, temperature):
    drafter = trained if DRAFTERS[which] is None else tiny_drafter(target, seed=6, **DRAFTERS[which])
    gen = torch.Generator().manual_seed(7)
    for prompt in prompts[:2]:
        steps = record_drafts(monkeypatch, drafter)
        out = drafter.spec_generate(target, prompt[None], NEW_TOKENS, temperature=temperature, return_stats=True,
                                    generator=gen)
        monkeypatch.undo()
        # each step anchors on the last committed token (the previous anchor plus what that
        # step committed) and drafts as many slots as the budget can still use; a step
        # with one token left has nothing to draft
        generated = [1 + sum(out.acceptance_lengths[:i]) for i in range(len(out.acceptance_lengths))]
        expected = [(PROMPT_LEN - 1 + g, min(BLOCK, NEW_TOKENS - g)) for g in generated]
        assert [(s["start"], s["width"]) for s in steps] == [e for e in expected if e[1] > 1]
        check_drafts_against_training_layout(target, drafter, steps, out.output_ids)
    if which == "trained" and temperature == 0:
        assert max(out.acceptance_lengths) == BLOCK and min(out.acceptance_lengths) < BLOCK


def full_block_steps(lengths, max_new_tokens, block):
    """The leading steps that drafted a whole block: the reference runtime's last blocks are
    one slot wider than ours (it drafts a slot it can never commit), so their drafts differ."""
    generated, n = 1, 0  # the prefill's token comes first
    while n < len(lengths) and max_new_tokens - generated >= block:
        generated += lengths[n]
        n += 1
    return n


def test_acceptance_lengths_equal_the_reference_runtime(monkeypatch, target, prompts, trained, tmp_path):
    reference = pytest.importorskip("dflash.model", reason="install with: pip install --no-deps dflash==0.1.0")
    monkeypatch.setattr(reference, "_cuda_time", __import__("time").perf_counter)  # it syncs CUDA for its stats
    ref = reference.DFlashDraftModel.from_pretrained(save_drafter(trained, tmp_path / "export")).eval()
    ours_all, compared = [], 0
    for prompt in prompts:
        ids = prompt[None]
        ours = trained.spec_generate(target, ids, NEW_TOKENS, return_stats=True)
        theirs = reference.dflash_generate(ref, target, ids, NEW_TOKENS, None, return_stats=True)
        assert torch.equal(ours.output_ids, theirs.output_ids)
        n = full_block_steps(ours.acceptance_lengths, NEW_TOKENS, BLOCK)
        assert ours.acceptance_lengths[:n] == theirs.acceptance_lengths[:n]
        ours_all += ours.acceptance_lengths
        compared += n
    tau = sum(ours_all) / len(ours_all)
    # the comparison has power: most steps accept drafts, and most steps are compared
    assert tau > 1.5, tau
    assert compared >= 0.75 * len(ours_all)
