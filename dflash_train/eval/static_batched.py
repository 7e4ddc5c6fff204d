"""Batched decoding on the static runtime: speculative and plain, several prompts per step.

The same buffers and replayable steps as the batch-1 static runtime (`StaticSpeculator`,
`TargetSlots` in model/dflash.py) with `rows` requests side by side, each at its own
positions: a row's K/V and context K/V sit in its own slots (slot i holds its position i),
its block starts at its own committed length, its masks hide its own uncommitted slots and
its own budget's end. So every row computes what its batch-1 static run computes and
accepts its own prefix; in float32 its greedy output is plain greedy decoding of that row
alone, and its acceptance lengths are its batch-1 static run's
(tests/unit/test_static_batched.py). Greedy, each decode step of the whole batch (draft,
verify, acceptance, commit) is decided on the device, one captured graph on a GPU, and the
host reads the rows' state only between runs of steps (`StaticSpeculator.run_greedy`).
Sampling: the drafter's forward and the verify are captured graphs, the drafter's pick of
the drafts runs eagerly (it draws from a generator), acceptance runs row by row and each
step copies one small (b, k + 2) tensor to the host. ``verify_tokens`` (k, default every
draft of a block): the drafts each row's verify checks, as in the batch-1 runtime. Every
drafter kind runs here: the block, the verify width and the pick are the drafter's.

Prefill: prompts are left-padded into one (b, P) forward. Row i's prompt sits at positions
0..n_i-1; its padding gets positions n_i, n_i+1, ...: slots past the prompt, which only a
block at those positions reads, and that block writes them first.

A row that has finished (budget or stop token) stays in the batch, its block frozen at its
last position, until every row has finished; nothing more is recorded for it. Shapes stay
fixed, so the graphs never change; the finished rows' share of each step is wasted work.

Shapes: b rows, P longest prompt, B block size, k verified drafts, V vocabulary.
"""

from __future__ import annotations

import torch

from dflash_train.eval.acceptance import next_token, timed
from dflash_train.eval.batched import Rows, batch_results, first_tokens, left_pad
from dflash_train.model.dflash import Sampling, SpecOutput, check_verify_tokens, device_clock
from dflash_train.model.runtime import (
    MAX_STOP_IDS,
    StaticSpeculator,
    TargetSlots,
    greedy_accepted,
    static_runtime,
    verify_drafts_on_device,
)


def slot_layout(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids (b, P) left-padded, positions (b, P), prompt lengths (b, 1): see the module doc."""
    ids, valid, positions = left_pad(prompts, device)
    lengths = torch.tensor([[len(p)] for p in prompts], device=device)
    col = torch.arange(ids.shape[1], device=device)[None]
    return ids, torch.where(valid, positions, lengths + col), lengths


def accept_rows(drafts, draft_probs, logits, sampling: Sampling, generator, usable: torch.Tensor,
                active: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's accepted draft count (b,) and next token (b,): `verify_drafts_on_device` row
    by row.

    drafts (b, k), logits (b, k+1, V), usable (b, 1): the drafts a row's budget can commit.
    Greedy runs as one batched rule on the device. Sampling calls the batch-1 rule per
    active row (finished rows draw nothing: accepted 0, token 0, never recorded).
    """
    if sampling.greedy:
        target_tokens = logits.argmax(-1)  # (b, B)
        accepted = greedy_accepted(drafts, target_tokens, usable)  # (b,)
        return accepted, target_tokens.gather(1, accepted[:, None])[:, 0]
    zero = torch.zeros((), dtype=torch.long, device=drafts.device)
    pairs = [verify_drafts_on_device(drafts[i], draft_probs[i], logits[i], sampling, generator, int(usable[i]))
             if active[i] else (zero, zero) for i in range(len(drafts))]
    return torch.stack([a for a, _ in pairs]), torch.stack([t for _, t in pairs])


def _runtime(drafter, target, prompts: list[list[int]], max_new_tokens: int, graphs: bool,
             verify_tokens: int | None) -> StaticSpeculator:
    rows, width = len(prompts), drafter.drafts_per_block + 1  # the widest verify
    return static_runtime(drafter, max(map(len, prompts)) + max_new_tokens + width,
                          lambda rt, size: rt.fits(drafter, target, size, graphs, rows, verify_tokens),
                          lambda size: StaticSpeculator(drafter, target, size, graphs, rows, verify_tokens))


@torch.inference_mode()
def speculate_static_batch(drafter, target, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling,
                           stop_token_ids=None, generator=None, graphs: bool = True,
                           verify_tokens: int | None = None) -> list[SpecOutput]:
    """Speculative decoding of ``prompts`` together on the static runtime: one `SpecOutput`
    per prompt (prefill_s and decode_s are the batch's)."""
    if drafter.mask_token_id is None:
        raise ValueError("no mask_token_id: set dflash_config.mask_token_id in the drafter config")
    check_verify_tokens(verify_tokens, drafter.drafts_per_block + 1)
    device = target.get_input_embeddings().weight.device
    rt = _runtime(drafter, target, prompts, max_new_tokens, graphs, verify_tokens)
    checked = rt.verify_width  # the anchor and the verified drafts
    t0 = device_clock(device)
    ids, positions, lengths = slot_layout(prompts, device)
    logits, feats = rt.verifier.forward(ids, positions, logits_to_keep=1)
    anchor = first_tokens(logits[:, -1], sampling, generator)  # (b,)
    stops = set(stop_token_ids or [])
    if sampling.greedy and len(stops) <= MAX_STOP_IDS:  # every step decided on the device
        rt.begin(anchor, lengths, lengths + max_new_tokens - 1, drafter.mask_token_id, stops)
        t1 = device_clock(device)
        rt.run_greedy((feats, positions))
        done = rt.results()
        t2 = device_clock(device)
        return [SpecOutput(output_ids=torch.tensor([p + new], dtype=torch.long), acceptance_lengths=steps,
                           num_new_tokens=len(new), prefill_s=t1 - t0, decode_s=t2 - t1)
                for p, (new, steps) in zip(prompts, done)]
    rows = Rows(len(prompts), max_new_tokens, stops, anchor.tolist())
    rt.end.copy_(lengths + max_new_tokens - 1)  # each row's last new token: no block slot there commits
    start = lengths.clone()  # (b, 1) each row's anchor position
    active = torch.tensor([not d for d in rows.done], device=device)
    first_ctx = (feats, positions)
    t1 = device_clock(device)
    while not all(rows.done):
        rt.set_block(anchor, start, drafter.mask_token_id)
        usable = (rt.end - start).clamp(max=checked) - 1  # (b, 1) the batch-1 runtime's usable drafts
        draft_probs = rt.fill_drafts(first_ctx, sampling, generator)
        first_ctx = None
        logits, step_feats = rt.verify_step()
        accepted, bonus = accept_rows(rt.verified[:, 1:], draft_probs, logits, sampling, generator, usable,
                                      [not d for d in rows.done])
        host = torch.cat([accepted[:, None], bonus[:, None], rt.verified[:, 1:]], 1).tolist()  # the one sync
        finished = list(rows.done)
        for i, (n, tok, *drafts) in enumerate(host):
            rows.record(i, drafts[:n] + [tok])
        # the next draft step writes these k+1 features' context K/V; its mask shows the committed ones
        rt.ctx_feats.copy_(step_feats)
        rt.ctx_pos.copy_(rt.verified_pos)
        start += torch.where(active, accepted + 1, 0)[:, None]  # finished rows stay where they are
        anchor = torch.where(active, bonus, anchor)
        if rows.done != finished:
            active = torch.tensor([not d for d in rows.done], device=device)
    t2 = device_clock(device)
    return [SpecOutput(output_ids=torch.tensor([p + new], dtype=torch.long), acceptance_lengths=steps,
                       num_new_tokens=len(new), prefill_s=t1 - t0, decode_s=t2 - t1)
            for p, new, steps in zip(prompts, rows.new, rows.lengths)]


@torch.inference_mode()
def plain_static_batch(model, prompts: list[list[int]], max_new_tokens: int, stop_token_ids=None,
                       temperature: float = 0.0) -> list[list[int]]:
    """Plain decoding of ``prompts`` together on the static runtime (one-token steps, a CUDA
    graph on a GPU): each row's new tokens, cut after its first stop token. Without stop
    tokens the host reads the tokens once, after the last step."""
    device = model.get_input_embeddings().weight.device
    rows, stops = len(prompts), set(stop_token_ids or [])
    rt = static_runtime(model, max(map(len, prompts)) + max_new_tokens,
                        lambda rt, size: rt.fits(model, size, True, rows),
                        lambda size: TargetSlots(model, size, width=1, rows=rows))
    ids, positions, lengths = slot_layout(prompts, device)
    logits = rt.forward(ids, positions, logits_to_keep=1)[0]
    record = Rows(rows, max_new_tokens, stops)
    tokens = []
    for step in range(max_new_tokens):
        token = next_token(logits[:, -1], temperature)  # (b, 1)
        tokens.append(token)
        if stops:  # a stop token can end the batch early: one copy a step
            for i, t in enumerate(token[:, 0].tolist()):
                record.record(i, [t])
            if all(record.done):
                break
        if step == max_new_tokens - 1:
            break
        rt.ids.copy_(token)
        torch.add(lengths, step, out=rt.positions)  # the position of the token just decoded
        logits = rt.step()[0]
    if not stops:
        for i, new in enumerate(torch.cat(tokens, 1).tolist()):
            record.record(i, new)
    return record.new


def compare_static_batch(drafter, model, prompt_ids: list[str], prompts: list[list[int]], max_new_tokens: int,
                         stop_token_ids: list[int], temperature: float = 0.0, seed: int = 0, turn: int = 1,
                         verify_tokens: int | None = None):
    """`compare_batch` on the static runtime: the batch decoded speculatively and plainly,
    each timed as a whole, every row's time its share of the batch's (no top-2 gaps)."""
    device = model.get_input_embeddings().weight.device
    torch.manual_seed(seed)
    spec = timed(lambda: speculate_static_batch(drafter, model, prompts, max_new_tokens, Sampling(temperature),
                                                stop_token_ids, verify_tokens=verify_tokens), device)
    torch.manual_seed(seed)
    plain = timed(lambda: plain_static_batch(model, prompts, max_new_tokens, stop_token_ids, temperature), device)
    return batch_results(prompt_ids, prompts, spec, plain, max_new_tokens, stop_token_ids, turn)
