"""A DSpark drafter in the bundled runtime on the real SmolLM2 target: B drafts a step drawn
left to right through the Markov head, a verify of B + 1 tokens, and greedy output equal to
the target's own in the dynamic and the static runtime (docs/design/dspark-dflash2.md
section 3.3)."""

from __future__ import annotations

import pytest
import torch

from dflash_train import contract
from dflash_train.model.dflash import FULL_ATTENTION, ContextCache, Sampling, target_features, visible_mask
from dflash_train.model.dspark import DSparkConfig, DSparkDraftModel
from dflash_train.model.io import load_drafter, save_drafter
from dflash_train.model.runtime import spec_generate
from dflash_train.training.dspark_loss import previous_tokens
from tests.conftest import SMOLLM2_MASK_ID, make_tiny_target
from tests.unit.test_runtime import CHI2_CRIT_7DF, DRAWS, NEW, VOCAB, chi_square, exact_marginals

BLOCK = 4
NEW_TOKENS = 24
PROMPT = "Count from one to twenty, separated by commas."


def dspark_drafter(target, seed: int = 0, rank: int = 32) -> DSparkDraftModel:
    cfg = DSparkConfig.from_target(target.config, mask_token_id=SMOLLM2_MASK_ID, num_hidden_layers=1,
                                   block_size=BLOCK, target_layer_ids=[2, 14], markov_rank=rank)
    torch.manual_seed(seed)
    return DSparkDraftModel(cfg).eval()


@pytest.fixture(scope="module")
def prompt(smollm2_tokenizer):
    text = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                                 add_generation_prompt=True)
    return torch.tensor([smollm2_tokenizer(text, add_special_tokens=False)["input_ids"]])


def greedy_reference(model, ids: torch.Tensor, n: int) -> list[int]:
    """The target's own greedy continuation, one full forward per token (no cache, no drafter)."""
    seq = ids[0].tolist()
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq


@pytest.fixture(scope="module")
def reference(smollm2, prompt):
    return greedy_reference(smollm2.model, prompt, NEW_TOKENS)


def oracle(target, reference: list[int], prompt_len: int) -> DSparkDraftModel:
    """A DSpark drafter whose drafts come from its Markov head alone: the backbone's output
    is 0 (final norm weight 0, so the base logits lm_head(0) are 0) and W2 W1[a] puts a large
    logit on the token that followed a in the target's greedy answer. Its drafts are then
    accepted wherever that answer is bigram-consistent, so steps commit up to B + 1 tokens."""
    drafter = dspark_drafter(target.model, seed=1)
    answer = reference[prompt_len - 1:]
    rows = {}
    with torch.no_grad():
        drafter.norm.weight.zero_()
        drafter.markov_head.markov_w1.weight.zero_()
        drafter.markov_head.markov_w2.weight.zero_()
        for a, b in zip(answer, answer[1:]):
            if a not in rows:
                rows[a] = len(rows)
                drafter.markov_head.markov_w1.weight[a, rows[a]] = 1.0
                drafter.markov_head.markov_w2.weight[b, rows[a]] = 50.0
    assert len(rows) <= drafter.config.markov_rank
    return drafter


def block_hidden(drafter, target, anchor: int, feats, start: int) -> torch.Tensor:
    """(1, B, H) the drafter's outputs for its whole block at ``start`` over context ``feats``."""
    block = drafter.first_block(anchor, NEW_TOKENS, SMOLLM2_MASK_ID, feats.device)
    return drafter.draft_hidden(target, block, feats, start, ContextCache())


def record_widths(model):
    """Input widths of every target forward (the prefill, then each verify)."""
    widths = []

    def hook(_module, args, kwargs):
        ids = args[0] if args else kwargs["input_ids"]
        widths.append(ids.shape[1])

    return widths, model.register_forward_pre_hook(hook, with_kwargs=True)


def expected_widths(lengths: list[int], new_tokens: int) -> list[int]:
    """The verify width of each step: the anchor and min(B, tokens still to commit - 1) drafts."""
    widths, done = [], 1  # the prefill commits the first token
    for n in lengths:
        widths.append(1 + min(BLOCK, new_tokens - done - 1))
        done += n
    return widths


@pytest.mark.parametrize("which", ["random", "oracle"])
def test_greedy_speculative_output_is_the_targets_own(smollm2, prompt, reference, which):
    drafter = dspark_drafter(smollm2.model) if which == "random" else oracle(smollm2, reference, prompt.shape[1])
    widths, handle = record_widths(smollm2.model)
    try:
        out = spec_generate(drafter, smollm2.model, prompt, NEW_TOKENS, return_stats=True, static=False)
    finally:
        handle.remove()
    assert out.output_ids[0].tolist() == reference
    assert widths[0] == prompt.shape[1]
    assert widths[1:] == expected_widths(out.acceptance_lengths, NEW_TOKENS)
    assert widths[1] == BLOCK + 1  # the anchor and all B drafts
    if which == "oracle":
        # whole blocks accepted: B drafts and the target's next token commit in one step
        assert max(out.acceptance_lengths) == BLOCK + 1
        assert sum(out.acceptance_lengths) / len(out.acceptance_lengths) > 2
    # the static runtime (the device loop, and the per-step loop a clock takes) accepts the same
    for timed in (False, True):
        static = spec_generate(drafter, smollm2.model, prompt, NEW_TOKENS, return_stats=True, static=True,
                               time_steps=timed)
        assert static.output_ids[0].tolist() == reference
        assert static.acceptance_lengths == out.acceptance_lengths


def test_drafts_are_drawn_left_to_right_from_the_markov_corrected_logits(smollm2, prompt):
    drafter = dspark_drafter(smollm2.model, seed=2)
    with torch.no_grad():  # a Markov bias large enough to change the drafts
        drafter.markov_head.markov_w1.weight.normal_(0, 1.0)
        drafter.markov_head.markov_w2.weight.normal_(0, 10.0)
    with torch.no_grad():
        out = smollm2.model(prompt, output_hidden_states=True)
    feats = target_features(out.hidden_states, drafter.target_layer_ids)
    anchor, start = int(out.logits[0, -1].argmax()), prompt.shape[1]
    hidden = block_hidden(drafter, smollm2.model, anchor, feats, start)[0]  # (B, H)
    base = smollm2.model.get_output_embeddings()(hidden)  # (B, V)
    head = drafter.markov_head
    greedy = None
    for sampling in (Sampling(), Sampling(temperature=0.8, top_k=50)):
        gen = torch.Generator().manual_seed(5)
        drafts, probs = drafter.propose(smollm2.model, anchor, BLOCK, NEW_TOKENS, feats, start, ContextCache(),
                                        SMOLLM2_MASK_ID, sampling, gen)
        assert drafts.shape == (BLOCK,)
        greedy = drafts if sampling.greedy else greedy
        prev = anchor
        for k in range(BLOCK):
            logits = base[k] + head.markov_w2.weight @ head.markov_w1.weight[prev]
            if sampling.greedy:
                assert int(drafts[k]) == int(logits.argmax())
            else:  # the verifier's q is the corrected distribution the draft was drawn from
                torch.testing.assert_close(probs[k], sampling.probs(logits[None])[0], rtol=0, atol=1e-5)
                assert probs[k][drafts[k]] > 0
            prev = int(drafts[k])
    assert not torch.equal(base.argmax(-1), greedy)  # the Markov head changed what is drafted


def test_export_round_trip_drafts_the_same(smollm2, prompt, reference, tmp_path):
    drafter = oracle(smollm2, reference, prompt.shape[1])
    with torch.no_grad():
        drafter.norm.weight.fill_(0.5)  # the backbone counts too
    path = save_drafter(drafter, tmp_path / "export")
    loaded = load_drafter(path, target=smollm2)
    assert isinstance(loaded, DSparkDraftModel)
    a = spec_generate(drafter, smollm2.model, prompt, NEW_TOKENS, return_stats=True, static=False)
    b = spec_generate(loaded, smollm2.model, prompt, NEW_TOKENS, return_stats=True, static=False)
    c = spec_generate(loaded, smollm2.model, prompt, NEW_TOKENS, return_stats=True, static=True)
    assert a.output_ids.tolist() == b.output_ids.tolist() == c.output_ids.tolist() == [reference]
    assert a.acceptance_lengths == b.acceptance_lengths == c.acceptance_lengths


def test_the_training_forward_and_the_runtime_agree_on_a_block(smollm2, prompt, reference):
    """The block at anchor p in the training layout (all features, the dense visibility mask,
    teacher-forced previous tokens) against the runtime's block at start p (the features of
    positions before p only): the same drafter outputs, and the training's previous token of
    slot k is x[p + k], the token the runtime feeds when the drafts before it are right."""
    drafter = dspark_drafter(smollm2.model, seed=3)
    seq = torch.tensor([reference])
    t, p = seq.shape[1], prompt.shape[1] + 3  # an anchor inside the answer
    feats = smollm2.features(seq, drafter.target_layer_ids)  # (1, T, n*H)
    anchors = torch.tensor([p])
    block = contract.block_input_ids(seq[0], anchors, BLOCK, SMOLLM2_MASK_ID).reshape(1, -1)  # (1, B)
    labels = contract.dspark_block_labels(seq[0], torch.ones(t, dtype=torch.long), anchors, BLOCK).reshape(1, -1)
    prev = previous_tokens(labels, block, BLOCK)
    assert labels[0].tolist() == seq[0, p + 1 : p + 1 + BLOCK].tolist()
    assert prev[0].tolist() == seq[0, p : p + BLOCK].tolist()
    positions = torch.cat([torch.arange(t), torch.arange(p, p + BLOCK)])[None]
    with torch.no_grad():
        noise = smollm2.model.get_input_embeddings()(block)
        trained = drafter(noise, feats, positions, {FULL_ATTENTION: visible_mask(anchors[None], t, BLOCK)})
    served = block_hidden(drafter, smollm2.model, int(seq[0, p]), feats[:, :p], p)
    torch.testing.assert_close(served, trained, rtol=0, atol=1e-4)


def test_sampled_dspark_drafts_keep_the_targets_distribution(one_thread):
    """Rejection sampling against the Markov-corrected q the drafts were drawn from keeps the
    target's distribution exactly (the chi-square check of tests/unit/test_runtime.py, on the
    same tiny target, exact marginals by enumeration)."""
    target = make_tiny_target("llama", vocab=VOCAB, layers=3, initializer_range=0.4, seed=11)
    cfg = DSparkConfig.from_target(target.config, mask_token_id=VOCAB - 1, num_hidden_layers=1, block_size=4,
                                   markov_rank=4, initializer_range=0.4)
    torch.manual_seed(13)
    drafter = DSparkDraftModel(cfg).eval()
    prompt = torch.tensor([[1, 5, 2, 3]])
    exact = exact_marginals(target, prompt, 0.6)
    gen = torch.Generator().manual_seed(4321)
    counts = torch.zeros(NEW, VOCAB)
    steps = []
    for _ in range(DRAWS):
        out = spec_generate(drafter, target, prompt, NEW, temperature=0.6, return_stats=True, generator=gen,
                            static=False)
        counts[torch.arange(NEW), out.output_ids[0, prompt.shape[1]:]] += 1
        steps.append(out.acceptance_lengths)
    chi2 = [chi_square(counts[k], exact[k]) for k in range(NEW)]
    assert max(chi2) < CHI2_CRIT_7DF, chi2
    assert any(len(s) > 1 for s in steps) and any(s[0] > 1 for s in steps)  # rejections and acceptances
