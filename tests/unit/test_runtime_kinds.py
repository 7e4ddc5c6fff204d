"""DFlash2 and DSpark drafters in every runtime on CPU, float32 (issue 38, item 3).

Each kind is trained here for a few full-batch steps on a tiny target's greedy answers (its
own loss: DFlash2's unary CE plus its selector term, DSpark's Markov-corrected CE on the
shifted labels), so its drafts are really accepted and steps of several lengths occur. Then:
greedy output is the target's plain greedy decoding in the dynamic runtime, the exported
loop, the static device loop and the static per-step loop, at several verify lengths; the
static runtime accepts at every step what the dynamic one does and computes the same drafter
outputs at the same anchors; batched rows (static and dynamic) are their batch-1 runs;
sampling keeps the target's distribution; and the kind's own pick (the selector walk, the
Markov head) changes what is accepted, so the equalities above test it.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from dflash_train.contract import (
    IGNORE_INDEX,
    block_input_ids,
    block_labels,
    dspark_block_labels,
)
from dflash_train.eval.acceptance import target_generate
from dflash_train.eval.batched import spec_generate_batch
from dflash_train.eval.job import decode_conversations
from dflash_train.eval.static_batched import speculate_static_batch
from dflash_train.model.dflash import Sampling
from dflash_train.model.dflash2 import DFlash2Config, DFlash2DraftModel
from dflash_train.model.dspark import DSparkConfig, DSparkDraftModel
from dflash_train.model.runtime import spec_generate
from dflash_train.model.target import TargetModel
from dflash_train.training.dspark_loss import previous_tokens
from tests.conftest import make_tiny_target
from tests.unit.test_eval_cli import CharTokenizer, chat_items, eval_cfg
from tests.unit.test_runtime import CHI2_CRIT_7DF, VOCAB, chi_square, exact_marginals
from tests.unit.test_runtime_drafter import (  # noqa: F401 (prompts, target: fixtures)
    MASK_ID,
    NEW_TOKENS,
    PROMPT_LEN,
    prompts,
    target,
    train_drafter,
    training_hidden,
)
from tests.unit.test_runtime_static import record_draft_outputs
from tests.unit.test_static_batched import ragged_rows
from tests.unit.test_verify_tokens import assert_every_runtime_is_lossless

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 4
TRAIN_STEPS = 60
KINDS = ("dflash2", "dspark")
VERIFY = [1, 2, None]  # None: every draft of a block (3 for DFlash2, 4 for DSpark)
ATOL = 1e-5  # float32: the masked B-wide block and the narrowed one differ by rounding only


def new_drafter(kind: str, target, seed: int = 5, **overrides):  # noqa: F811
    common = dict(mask_token_id=overrides.pop("mask_token_id", MASK_ID), num_hidden_layers=1, block_size=BLOCK,
                  **overrides)
    torch.manual_seed(seed)
    if kind == "dflash2":
        return DFlash2DraftModel(DFlash2Config.from_target(target.config, conv_group_size=16, selector_rank=8,
                                                           selector_top_k=8, **common))
    return DSparkDraftModel(DSparkConfig.from_target(target.config, markov_rank=8, **common))


def kind_loss(kind: str, drafter, target, seqs, anchors, loss_mask) -> torch.Tensor:  # noqa: F811
    """The kind's own training loss over every block at ``anchors`` (b, N) of ``seqs`` (b, T)."""
    hidden = training_hidden(target, drafter, seqs, anchors, BLOCK)  # (b, N*B, H)
    head = target.get_output_embeddings()
    if kind == "dspark":  # slot k predicts x[p+k+1], its logits corrected by the gold token before it
        labels = torch.stack([dspark_block_labels(s, loss_mask, a, BLOCK) for s, a in zip(seqs, anchors)]).flatten(1)
        blocks = torch.stack([block_input_ids(s, a, BLOCK, MASK_ID) for s, a in zip(seqs, anchors)]).flatten(1)
        logits = drafter.markov_logits(head(hidden), previous_tokens(labels, blocks, BLOCK).clamp(min=0))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    labels = torch.stack([block_labels(s, loss_mask, a, BLOCK) for s, a in zip(seqs, anchors)]).flatten(1)
    unary = F.cross_entropy(head(hidden).flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    rows = labels.flatten() != IGNORE_INDEX
    # slot k's teacher-forced predecessor x[p+k-1] (the anchor for slot 1)
    before = (anchors[:, :, None] + torch.arange(BLOCK) - 1).clamp(0, seqs.shape[1] - 1).flatten(1)  # (b, N*B)
    pred = seqs.gather(1, before).flatten()
    logits = head(hidden).flatten(0, 1)[rows].float()  # (M, V)
    cand = logits.detach().topk(drafter.selector_top_k, dim=-1).indices  # the unary top-K, chosen without gradient
    term, _ = drafter.selector_loss(hidden.flatten(0, 1)[rows], pred[rows], labels.flatten()[rows], cand,
                                    logits.gather(1, cand), torch.ones(int(rows.sum())))
    return unary + term / rows.sum()


def train(kind: str, target, prompts):  # noqa: F811
    """A drafter of ``kind`` half-way to memorising the target's greedy answers to ``prompts``."""
    return train_drafter(target, prompts, BLOCK, TRAIN_STEPS, drafter=new_drafter(kind, target),
                         loss=lambda drafter, seqs, anchors, mask: kind_loss(kind, drafter, target, seqs, anchors,
                                                                             mask))


@pytest.fixture(scope="module")
def trained(target, prompts):  # noqa: F811
    return {kind: train(kind, target, prompts) for kind in KINDS}


def most(drafter, k) -> int:
    """Tokens a step commits at most: the verified drafts and the target's own."""
    return (k or drafter.drafts_per_block) + 1


def plain(target, ids, new_tokens=NEW_TOKENS):  # noqa: F811
    return target_generate(target, ids, new_tokens)


@pytest.mark.parametrize("k", VERIFY, ids=lambda k: f"k{k}")
@pytest.mark.parametrize("kind", KINDS)
def test_every_runtime_is_lossless_and_the_static_one_accepts_what_the_dynamic_one_does(
        target, prompts, trained, kind, k):  # noqa: F811
    drafter = trained[kind]
    assert_every_runtime_is_lossless(drafter, target, prompts, k, most(drafter, k))


@pytest.mark.parametrize("kind", KINDS)
def test_every_draft_step_equals_the_dynamic_runtime(monkeypatch, target, prompts, trained, kind):  # noqa: F811
    """The same anchors and, on the slots the dynamic block has (DSpark: all B, at every step;
    DFlash2: the budget's, its last blocks narrowed), the same drafter outputs."""
    drafter = trained[kind]
    widths = set()
    for prompt, new_tokens in [(p, n) for p in prompts for n in (NEW_TOKENS, 13, 14)]:
        steps = record_draft_outputs(monkeypatch, drafter)
        spec_generate(drafter, target, prompt[None], new_tokens, static=True)
        spec_generate(drafter, target, prompt[None], new_tokens, static=False)
        monkeypatch.undo()
        assert [s for s, _ in steps["static"]] == [s for s, _ in steps["dynamic"]]
        for (start, ours), (_, theirs) in zip(steps["static"], steps["dynamic"]):
            torch.testing.assert_close(ours[: len(theirs)], theirs, atol=ATOL, rtol=1e-5,
                                       msg=lambda m, start=start: f"draft step at start={start}: {m}")
            widths.add(len(theirs))
    # DSpark runs its whole block at every step; DFlash2's last blocks are narrowed
    assert widths == {BLOCK} if kind == "dspark" else min(widths) < BLOCK, widths


def without_own_pick(kind: str, drafter):
    """A copy whose kind-specific pick adds nothing: DFlash2's successor codebook at zero (the
    walk is the unary argmax), DSpark's Markov bias at zero (the base logits' argmax)."""
    twin = copy.deepcopy(drafter)
    with torch.no_grad():
        if kind == "dflash2":
            twin.candidate_selector.successor_codebook.zero_()
        else:
            twin.markov_head.markov_w2.weight.zero_()
    return twin


@pytest.mark.parametrize("kind", KINDS)
def test_the_kinds_own_pick_changes_what_is_accepted(target, prompts, trained, kind):  # noqa: F811
    """So the static runtime's equality with the dynamic one above covers the walk and the
    Markov loop: the same backbone without them accepts differently."""
    drafter = trained[kind]
    twin = without_own_pick(kind, drafter)
    ours = [spec_generate(drafter, target, p[None], NEW_TOKENS, return_stats=True, static=True).acceptance_lengths
            for p in prompts]
    theirs = [spec_generate(twin, target, p[None], NEW_TOKENS, return_stats=True, static=True).acceptance_lengths
              for p in prompts]
    assert ours != theirs


@pytest.mark.parametrize("k", [2, None], ids=lambda k: f"k{k}")
@pytest.mark.parametrize("kind", KINDS)
def test_batched_rows_are_their_batch_one_runs(target, prompts, trained, kind, k):  # noqa: F811
    drafter = trained[kind]
    rows = ragged_rows(target, prompts)
    singles = [spec_generate(drafter, target, torch.tensor([p]), NEW_TOKENS, return_stats=True, static=True,
                             verify_tokens=k) for p in rows]
    expected = [plain(target, torch.tensor([p]))[0, len(p):].tolist() for p in rows]
    steps = []
    for size in (2, 3, 5):
        static = speculate_static_batch(drafter, target, rows[:size], NEW_TOKENS, Sampling(), verify_tokens=k)
        dynamic = spec_generate_batch(drafter, target, rows[:size], NEW_TOKENS, Sampling(), verify_tokens=k)
        assert drafter.__dict__["_static_runtime"].block.shape == (size, BLOCK)
        assert drafter.__dict__["_static_runtime"].verify_width == most(drafter, k)
        for p, fixed, grown, one, new in zip(rows, static, dynamic, singles, expected):
            assert fixed.output_ids[0, len(p):].tolist() == new == grown.output_ids[0, len(p):].tolist()
            assert fixed.acceptance_lengths == one.acceptance_lengths  # each row accepts its own prefix
            assert max(grown.acceptance_lengths) <= most(drafter, k)
            steps += fixed.acceptance_lengths
    assert max(steps) == most(drafter, k) and min(steps) == 1


@pytest.fixture(scope="module")
def sampling_models():
    """A peaked tiny target over 8 tokens and a random drafter of each kind for it."""
    tiny = make_tiny_target("llama", vocab=VOCAB, layers=3, initializer_range=0.4, seed=11)
    drafters = {kind: new_drafter(kind, tiny, seed=13, mask_token_id=VOCAB - 1, initializer_range=0.4).eval()
                for kind in KINDS}
    with torch.no_grad():  # a DFlash2 selector that rescores: its successor codebook starts at zero
        drafters["dflash2"].candidate_selector.successor_codebook.normal_(0, 0.4)
    return tiny, drafters


@pytest.mark.parametrize("runtime", ["static", "dynamic"])
@pytest.mark.parametrize("kind", KINDS)
def test_batched_sampling_keeps_the_target_distribution(sampling_models, kind, runtime, few_static_slots):
    """Rejection sampling against the q each kind drew its drafts from (DFlash2's scattered
    candidate distribution, DSpark's Markov-corrected one) keeps the target's distribution:
    the chi-square check of tests/unit/test_runtime.py, rows of one batch as draws."""
    tiny, drafters = sampling_models
    decode = speculate_static_batch if runtime == "static" else spec_generate_batch
    prompt, new, temperature, rows, rounds = [1, 5, 2, 3], 4, 0.6, 250, 12
    exact = exact_marginals(tiny, torch.tensor([prompt]), temperature)
    gen = torch.Generator().manual_seed(99)
    counts = torch.zeros(new, VOCAB)
    lengths = []
    for _ in range(rounds):
        for out in decode(drafters[kind], tiny, [prompt] * rows, new, Sampling(temperature), generator=gen):
            counts[torch.arange(new), out.output_ids[0, len(prompt):]] += 1
            lengths += out.acceptance_lengths
    chi2 = [chi_square(counts[k], exact[k]) for k in range(new)]
    assert max(chi2) < CHI2_CRIT_7DF, chi2
    assert max(lengths) > 1 and min(lengths) == 1  # drafts were accepted and rejected
    # the same counts drawn at temperature 1 fail: the check has power
    wrong = exact_marginals(tiny, torch.tensor([prompt]), 1.0)
    assert min(chi_square(counts[k], wrong[k]) for k in range(new)) > CHI2_CRIT_7DF


@pytest.mark.parametrize("kind", KINDS)
def test_eval_decodes_each_kind_on_every_runtime(target, trained, kind):  # noqa: F811
    """dflash-eval's decode loop: runtime=static and dynamic at batch 1, and batches of 2."""
    tok, items = CharTokenizer(), chat_items(CharTokenizer())
    model = TargetModel(target)
    runs = {}
    for runtime, batch in (("static", 1), ("dynamic", 1), ("dynamic", 2)):
        cfg = eval_cfg("drafter_path=random", "max_new_tokens=9", f"runtime={runtime}", f"batch_size={batch}")
        runs[runtime, batch] = decode_conversations(cfg, trained[kind], model, tok, items, [], 0)
        assert all(r.spec_ids == r.plain_ids for r in runs[runtime, batch]) and len(runs[runtime, batch]) == 6
    assert [r.acceptance_lengths for r in runs["static", 1]] == [r.acceptance_lengths for r in runs["dynamic", 1]]
