"""verify_tokens: the drafter drafts its whole block, the target verifies only its first k drafts.

For a block-16 drafter that really is accepted (steps that accept every verified draft at
each k), every runtime gives the target's plain greedy output at k = 1, 3, 7 and the default
(15), commits at most k+1 tokens a step, and the static runtime (device loop and per-step
loop) accepts at every step what the dynamic one does. The drafts still come from the
committed context only: each draft step equals the training forward over the committed
sequence. Sampling at k < B-1 keeps the target's distribution. A k outside 1..B-1 is refused
with its value named.
"""

import pytest
import torch

from dflash_train.eval.acceptance import target_generate
from dflash_train.eval.batched import spec_generate_batch
from dflash_train.eval.job import decode_conversations
from dflash_train.eval.static_batched import speculate_static_batch
from dflash_train.model.dflash import Sampling
from dflash_train.model.runtime import spec_generate
from tests.cli_helpers import assert_one_line_error, run_cli
from tests.unit.test_eval_cli import CharTokenizer, chat_items, chat_models, eval_cfg  # noqa: F401 (fixture)
from tests.unit.test_runtime import (  # noqa: F401
    CHI2_CRIT_7DF,
    VOCAB,
    chi_square,
    exact_marginals,
    models,
)
from tests.unit.test_runtime_drafter import (  # noqa: F401 (prompts, target: fixtures)
    NEW_TOKENS,
    check_drafts_against_training_layout,
    prompts,
    record_drafts,
    target,
    train_drafter,
)

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 16
# 50 steps give tau about 3 at the whole block, and at k = 1, 3, 7 steps that accept all k
TRAIN_STEPS = 50
VERIFY = [1, 3, 7, None]
DRAWS = 600  # whole decodes per sampling check; the power check below fails by 3x or more at this count


@pytest.fixture(scope="module")
def drafter(target, prompts):  # noqa: F811
    return train_drafter(target, prompts, BLOCK, TRAIN_STEPS)


def _plain(target, ids):  # noqa: F811
    return target_generate(target, ids, NEW_TOKENS)


def assert_every_runtime_is_lossless(drafter, target, prompts, k, most):  # noqa: F811
    """On each prompt, greedy output equal to plain decoding in the dynamic runtime, the
    exported loop, the static device loop and the static per-step loop at verify_tokens=k,
    each step committing at most ``most`` tokens and every runtime accepting what the dynamic
    one does; over the prompts, some steps commit ``most`` and some fewer."""
    lengths = []
    for prompt in prompts:
        ids = prompt[None]
        plain = target_generate(target, ids, NEW_TOKENS)
        dynamic = spec_generate(drafter, target, ids, NEW_TOKENS, return_stats=True, static=False, verify_tokens=k)
        exported = drafter.spec_generate(target, ids, NEW_TOKENS, return_stats=True, verify_tokens=k)
        loop = spec_generate(drafter, target, ids, NEW_TOKENS, return_stats=True, static=True, verify_tokens=k)
        # a clock takes the static runtime's per-step loop (the one sampling uses)
        stepped = spec_generate(drafter, target, ids, NEW_TOKENS, return_stats=True, static=True, time_steps=True,
                                verify_tokens=k)
        for out in (dynamic, exported, loop, stepped):
            assert torch.equal(out.output_ids, plain)
            assert max(out.acceptance_lengths) <= most and sum(out.acceptance_lengths) == NEW_TOKENS - 1
        assert exported.acceptance_lengths == dynamic.acceptance_lengths
        assert loop.acceptance_lengths == dynamic.acceptance_lengths == stepped.acceptance_lengths
        lengths += dynamic.acceptance_lengths
    # the check has power: some steps accept every verified draft, some stop short
    assert max(lengths) == most and min(lengths) < most


@pytest.mark.parametrize("k", VERIFY, ids=lambda k: f"k{k or BLOCK - 1}")
def test_every_runtime_is_lossless_and_commits_at_most_k_plus_one(target, prompts, drafter, k):  # noqa: F811
    assert_every_runtime_is_lossless(drafter, target, prompts, k, (k or BLOCK - 1) + 1)


@pytest.mark.parametrize("k", VERIFY, ids=lambda k: f"k{k or BLOCK - 1}")
def test_batched_runtimes_are_lossless_at_every_k(target, prompts, drafter, k):  # noqa: F811
    rows = [p.tolist() for p in prompts]
    most = (k or BLOCK - 1) + 1
    batched = spec_generate_batch(drafter, target, rows, NEW_TOKENS, Sampling(), verify_tokens=k)
    static = speculate_static_batch(drafter, target, rows, NEW_TOKENS, Sampling(), verify_tokens=k)
    for p, out, fixed in zip(rows, batched, static):
        ids = torch.tensor([p])
        plain = _plain(target, ids)
        assert torch.equal(out.output_ids, plain) and torch.equal(fixed.output_ids, plain)
        assert max(out.acceptance_lengths) <= most
        one = spec_generate(drafter, target, ids, NEW_TOKENS, return_stats=True, static=True, verify_tokens=k)
        assert fixed.acceptance_lengths == one.acceptance_lengths  # each row is its batch-1 static run
    assert drafter.__dict__["_static_runtime"].verify_width == most


def test_drafts_read_only_the_committed_context_at_a_short_verify(monkeypatch, target, prompts, drafter):  # noqa: F811
    """At k=3 a step's verify writes 4 features; only the committed ones may reach the
    drafter: every draft step equals the training forward over the committed sequence."""
    for prompt in prompts[:2]:
        steps = record_drafts(monkeypatch, drafter)
        out = drafter.spec_generate(target, prompt[None], NEW_TOKENS, return_stats=True, verify_tokens=3)
        monkeypatch.undo()
        assert [s["width"] for s in steps][:2] == [BLOCK, BLOCK]  # the whole block is drafted
        check_drafts_against_training_layout(target, drafter, steps, out.output_ids)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_sampling_at_a_short_verify_keeps_the_target_distribution(models, static):  # noqa: F811
    tiny, small = models  # block 4: k=1 verifies one of its three drafts
    prompt, new, temperature = torch.tensor([[1, 5, 2, 3]]), 4, 1.5
    exact = exact_marginals(tiny, prompt, temperature)
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(new, VOCAB)
    for _ in range(DRAWS):
        out = spec_generate(small, tiny, prompt, new, temperature=temperature, return_stats=True, generator=gen,
                            static=static, verify_tokens=1)
        counts[torch.arange(new), out.output_ids[0, prompt.shape[1]:]] += 1
        assert max(out.acceptance_lengths) <= 2
    assert max(chi_square(counts[k], exact[k]) for k in range(new)) < CHI2_CRIT_7DF, counts
    wrong = exact_marginals(tiny, prompt, 1.0)  # the same counts drawn at temperature 1 fail: the check has power
    assert min(chi_square(counts[k], wrong[k]) for k in range(new)) > 3 * CHI2_CRIT_7DF


@pytest.mark.parametrize("bad", [0, BLOCK, -1, True, 2.0])
def test_a_verify_length_outside_the_block_is_refused(target, drafter, bad):  # noqa: F811
    ids = torch.tensor([[1, 2, 3]])
    message = rf"verify_tokens={bad!r}: must be an integer in 1\.\.{BLOCK - 1}"
    for run in (lambda: spec_generate(drafter, target, ids, 4, static=False, verify_tokens=bad),
                lambda: spec_generate(drafter, target, ids, 4, static=True, verify_tokens=bad),
                lambda: drafter.spec_generate(target, ids, 4, verify_tokens=bad),
                lambda: spec_generate_batch(drafter, target, [[1, 2]], 4, Sampling(), verify_tokens=bad),
                lambda: speculate_static_batch(drafter, target, [[1, 2]], 4, Sampling(), verify_tokens=bad)):
        with pytest.raises(ValueError, match=message):
            run()


def test_eval_decodes_at_a_short_verify(chat_models):  # noqa: F811
    model, small = chat_models  # block 4
    tok, items = CharTokenizer(), chat_items(CharTokenizer())
    for runtime in ("dynamic", "static"):
        cfg = eval_cfg("drafter_path=random", "max_new_tokens=7", f"runtime={runtime}", "verify_tokens=1")
        results = decode_conversations(cfg, small, model, tok, items, [], 0)
        assert all(r.spec_ids == r.plain_ids for r in results) and len(results) == 6
        assert {n for r in results for n in r.acceptance_lengths} <= {1, 2}
    with pytest.raises(ValueError, match="verify_tokens=0: must be >= 1"):
        eval_cfg("drafter_path=random", "verify_tokens=0")


def test_dflash_eval_names_a_verify_length_past_the_drafters_block(tmp_path):
    # the bound comes from the drafter (a fresh b16 one here): checked once it is built
    done = run_cli("dflash-eval", "drafter_path=random", "verify_tokens=16", "limit=1", f"output_dir={tmp_path / 'e'}")
    assert_one_line_error(done, "dflash-eval", "verify_tokens=16: must be an integer in 1..15")
