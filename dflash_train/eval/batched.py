"""Many prompts at once: batched speculative and plain decoding for ``dflash-eval``.

Rows commit different numbers of tokens per step, so neither cache can be cropped to one
length. Instead every step appends the whole block to both caches (the target's KV and the
drafter's context K/V) and a per-row validity mask hides what was not committed: the
rejected drafts' slots, and the left padding of shorter prompts. Positions are per row, so
each row sees exactly the keys, at exactly the positions, that its batch-1 run sees; in
float32 its greedy output is the batch-1 output (tests/unit/test_eval_batched.py). The
caches grow by B slots a step whatever was accepted; when the fullest row holds valid
keys in at most half of a cache's slots, the cache is compacted (each row's valid slots
gathered, in order, to the right), so attention reads about twice the committed length
at most, not B slots per step. This is an evaluation tool, not a server.

A row that has finished (stop token or budget) keeps decoding with the others until the
whole batch has finished; nothing more is recorded for it. Every block is B slots wide;
the batch-1 runtime narrows its last blocks to the remaining budget, so the acceptance
lengths of a row's last steps can differ from its batch-1 run (its output cannot).
``verify_tokens`` (k, default every draft of a block: B-1, or B for DSpark): the target
verifies each block's anchor and first k drafts, so both caches grow by k+1 slots a step.
The drafts are picked by the drafter's own `pick_drafts`, so every drafter kind runs here.

Shapes: b rows, P longest prompt, B block size, k verified drafts, L cache length, V vocabulary.
"""

from __future__ import annotations

import torch

from dflash_train.model.dflash import (
    FULL_ATTENTION,
    NO_CLOCK,
    SLIDING_ATTENTION,
    ContextCache,
    Sampling,
    SpecOutput,
    check_verify_tokens,
    device_clock,
    stalled,
    target_features,
    verify_drafts,
)

PAD_ID = 0  # any valid id: padded slots are masked out and never read


def left_pad(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids (b, P), valid (b, P) bool, positions (b, P): each prompt right-aligned, so every
    row's last prompt token sits in the last column."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
    lengths = torch.tensor([len(p) for p in prompts])
    col = torch.arange(width)
    valid = col[None] >= (width - lengths)[:, None]
    positions = (col[None] - (width - lengths)[:, None]).clamp_min(0)
    return ids.to(device), valid.to(device), positions.to(device)


def first_tokens(logits: torch.Tensor, sampling: Sampling, generator) -> torch.Tensor:
    """(b, V) -> (b,)"""
    if sampling.greedy:
        return logits.argmax(-1)
    return torch.multinomial(sampling.probs(logits), 1, generator=generator)[:, 0]


def _draft_masks(drafter, ctx_valid, ctx_pos, block_pos) -> dict:
    """Per layer type (b, 1, B, C + B) bool: a block slot sees the valid context keys and
    its block (causally and within the window for sliding layers), as in batch 1."""
    b, width = block_pos.shape
    slot = torch.arange(width, device=block_pos.device)
    see_ctx = ctx_valid[:, None, :].expand(b, width, -1)  # (b, B, C)
    masks = {FULL_ATTENTION: torch.cat([see_ctx, see_ctx.new_ones(b, width, width)], -1)[:, None]}
    if SLIDING_ATTENTION in drafter.layer_types:
        window = drafter.config.sliding_window
        near = block_pos[:, :, None] - ctx_pos[:, None, :] < window  # (b, B, C)
        causal = (slot[None, :] <= slot[:, None]) & (slot[:, None] - slot[None, :] < window)  # (B, B)
        masks[SLIDING_ATTENTION] = torch.cat([see_ctx & near, causal.expand(b, -1, -1)], -1)[:, None]
    return masks


class Rows:
    """What each row has committed and what is recorded for it."""

    def __init__(self, num_rows: int, max_new_tokens: int, stops: set, first: list[int] | None = None):
        self.max_new_tokens, self.stops = max_new_tokens, stops
        self.new = [[] if first is None else [first[i]] for i in range(num_rows)]  # recorded new tokens
        self.lengths = [[] for _ in range(num_rows)]  # tokens committed per verify step
        self.done = [bool(self.new[i]) and self._finished(i) for i in range(num_rows)]

    def _finished(self, i) -> bool:
        return len(self.new[i]) >= self.max_new_tokens or self.new[i][-1] in self.stops

    def record(self, i, committed: list[int]) -> None:
        if self.done[i]:
            return
        committed = committed[: self.max_new_tokens - len(self.new[i])]
        for k, tok in enumerate(committed):
            if tok in self.stops:
                committed = committed[: k + 1]
                break
        if not committed:
            raise stalled(len(self.lengths[i]), i)
        self.new[i] += committed
        self.lengths[i].append(len(committed))
        self.done[i] = self._finished(i)


def _accept(block, draft_probs, logits, sampling, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Accepted draft counts (b,) and the tokens that follow them (b,), row by row as batch 1.
    block (b, k+1): the anchor and the verified drafts; logits (b, k+1, V)."""
    if sampling.greedy:
        target_tokens = logits.argmax(-1)  # (b, k+1)
        accepted = (block[:, 1:] == target_tokens[:, :-1]).long().cumprod(1).sum(1)  # (b,)
        return accepted, target_tokens.gather(1, accepted[:, None])[:, 0]
    pairs = [verify_drafts(block[i, 1:], draft_probs[i], logits[i], sampling, generator) for i in range(len(block))]
    return (torch.tensor([a for a, _ in pairs], device=block.device),
            torch.stack([torch.as_tensor(t, device=block.device) for _, t in pairs]))


def _compaction(valid: torch.Tensor, longest: int) -> torch.Tensor | None:
    """(b, L') gather index keeping each row's valid slots in order, right-aligned, when the
    fullest row (``longest`` valid slots) fills at most half of the L slots; else None."""
    if 2 * longest > valid.shape[1]:
        return None
    order = torch.sort(valid.long(), dim=1, stable=True).indices  # invalid slots first, each group in order
    return order[:, valid.shape[1] - longest:]


def _gather_slots(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """(b, h, L, d) -> (b, h, L', d): the slots ``idx`` (b, L') of each row."""
    b, h, _, d = t.shape
    return t.gather(2, idx[:, None, :, None].expand(b, h, idx.shape[1], d))


def _compactable(cache) -> bool:
    """A transformers cache whose layers all hold their full K/V (no sliding window, no
    quantisation): those can be gathered slot by slot."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer).__name__ == "DynamicLayer" for layer in layers)


@torch.inference_mode()
def spec_generate_batch(drafter, target, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling,
                        stop_token_ids=None, generator=None, clock=NO_CLOCK,
                        verify_tokens: int | None = None) -> list[SpecOutput]:
    """Speculative decoding of several prompts together; one `SpecOutput` per prompt.

    prefill_s and decode_s are the batch's (the same for every row); step_times, when
    ``clock`` is a StepClock, too.
    """
    from transformers import DynamicCache

    mask_id, width = drafter.mask_token_id, drafter.block_size
    checked = check_verify_tokens(verify_tokens, drafter.drafts_per_block + 1) + 1  # the anchor and the drafts
    device = target.device
    t0 = device_clock(device)
    ids, valid, positions = left_pad(prompts, device)
    cache = DynamicCache(config=target.config)
    out = target(ids, attention_mask=valid.long(), position_ids=positions, past_key_values=cache, use_cache=True,
                 output_hidden_states=True, logits_to_keep=1)
    first = first_tokens(out.logits[:, -1], sampling, generator)  # (b,)
    rows = Rows(len(prompts), max_new_tokens, set(stop_token_ids or []), first.tolist())
    key_valid = valid  # (b, L) which target cache slots hold committed tokens
    # the drafter's context: features not yet in its cache, and what its cache holds
    new_feats, new_valid, new_pos = target_features(out.hidden_states, drafter.target_layer_ids), valid, positions
    ctx_valid = ctx_pos = valid[:, :0]
    draft_cache = ContextCache()
    anchor, start = first, torch.tensor([len(p) for p in prompts], device=device)  # (b,) position of the anchor
    slot = torch.arange(max(width, checked), device=device)
    embed = target.get_input_embeddings()
    committed = [len(p) for p in prompts]  # valid slots per row, in the target's cache and the drafter's
    compact = _compactable(cache)
    t1 = device_clock(device)
    while not all(rows.done):
        clock.lap()
        block = torch.full((len(prompts), width), mask_id, dtype=torch.long, device=device)
        block[:, 0] = anchor
        block_pos = start[:, None] + slot[:width]  # (b, B)
        ctx_valid, ctx_pos = torch.cat([ctx_valid, new_valid], 1), torch.cat([ctx_pos, new_pos], 1)
        # zeroed: a padded slot's features may be anything (even NaN), and 0 * NaN is NaN
        feats = new_feats.masked_fill(~new_valid[..., None], 0.0)
        hidden = drafter(embed(block), feats, torch.cat([new_pos, block_pos], 1),
                         _draft_masks(drafter, ctx_valid, ctx_pos, block_pos), draft_cache, True)
        idx = _compaction(ctx_valid, max(committed)) if compact else None
        if idx is not None:  # the drafter's context holds what the target's cache held before this step
            draft_cache.keys = [_gather_slots(k, idx) for k in draft_cache.keys]
            draft_cache.values = [_gather_slots(v, idx) for v in draft_cache.values]
            ctx_valid, ctx_pos = ctx_valid.gather(1, idx), ctx_pos.gather(1, idx)
        drafts, draft_probs = drafter.pick_drafts(target, hidden, anchor, checked - 1, sampling, generator)
        block = torch.cat([anchor[:, None], drafts], 1)  # (b, k+1) what the target verifies
        block_pos = start[:, None] + slot[:checked]
        clock.lap("draft")
        mask = torch.cat([key_valid, key_valid.new_ones(block.shape)], 1).long()  # (b, L + k+1)
        out = target(block, attention_mask=mask, position_ids=block_pos, past_key_values=cache, use_cache=True,
                     output_hidden_states=True)
        accepted, bonus = _accept(block, draft_probs, out.logits, sampling, generator)
        clock.lap("verify")
        for i, (n, tok) in enumerate(zip(accepted.tolist(), bonus.tolist())):
            rows.record(i, block[i, 1 : n + 1].tolist() + [tok])
            committed[i] += n + 1
        # the anchor and the accepted drafts are committed; their features are the next context
        new_valid = slot[None, :checked] <= accepted[:, None]  # (b, k+1)
        key_valid = torch.cat([key_valid, new_valid], 1)
        idx = _compaction(key_valid, max(committed)) if compact else None
        if idx is not None:
            for layer in cache.layers:
                layer.keys, layer.values = _gather_slots(layer.keys, idx), _gather_slots(layer.values, idx)
            key_valid = key_valid.gather(1, idx)
        new_feats, new_pos = target_features(out.hidden_states, drafter.target_layer_ids), block_pos
        anchor, start = bonus, start + accepted + 1
        clock.lap("bookkeeping")
    t2 = device_clock(device)
    return [SpecOutput(output_ids=torch.tensor([p + new], dtype=torch.long), acceptance_lengths=lengths,
                       num_new_tokens=len(new), prefill_s=t1 - t0, decode_s=t2 - t1, step_times=clock.result())
            for p, new, lengths in zip(prompts, rows.new, rows.lengths)]


@torch.inference_mode()
def target_generate_batch(model, prompts: list[list[int]], max_new_tokens: int, stop_token_ids=None,
                          temperature: float = 0.0, gaps_ulps: list[list[float]] | None = None) -> list[list[int]]:
    """Plain decoding of several prompts together: each row's new tokens, cut after its first
    stop token. ``gaps_ulps`` (one list per row) receives each recorded step's top-2 gap."""
    from transformers import DynamicCache

    from dflash_train.eval.acceptance import next_token, top2_gaps_ulps

    ids, valid, positions = left_pad(prompts, model.device)
    cache = DynamicCache(config=model.config)
    out = model(ids, attention_mask=valid.long(), position_ids=positions, past_key_values=cache, use_cache=True,
                logits_to_keep=1)
    rows = Rows(len(prompts), max_new_tokens, set(stop_token_ids or []))
    mask, position = valid.long(), positions[:, -1]
    tops, recorded = [], [[] for _ in prompts]  # each step's (b, 2) top logits; the steps each row recorded
    while True:
        token = next_token(out.logits[:, -1], temperature)  # (b, 1)
        if gaps_ulps is not None:  # kept on the device: one copy after the loop, not one per row and step
            tops.append(out.logits[:, -1].topk(2).values)
        for i, t in enumerate(token[:, 0].tolist()):
            if not rows.done[i]:
                recorded[i].append(len(tops) - 1)
            rows.record(i, [t])
        if all(rows.done):
            break
        mask, position = torch.cat([mask, mask.new_ones(len(prompts), 1)], 1), position + 1
        out = model(token, attention_mask=mask, position_ids=position[:, None], past_key_values=cache, use_cache=True)
    if gaps_ulps is not None:
        top = torch.stack(tops).cpu()  # (steps, b, 2)
        for i, steps in enumerate(recorded):
            gaps_ulps[i].extend(top2_gaps_ulps([top[s, i] for s in steps], model.dtype))
    return rows.new


def compare_batch(drafter, model, prompt_ids: list[str], prompts: list[list[int]], max_new_tokens: int,
                  stop_token_ids: list[int], temperature: float = 0.0, seed: int = 0, turn: int = 1,
                  time_steps: bool = False, verify_tokens: int | None = None):
    """`compare_prompt` for several prompts decoded together, each run timed as a whole.

    Each row's spec_s / plain_s is its share of the batch's wall time (the time split
    evenly), so tokens/s summed over a dataset is the batches' throughput.
    """
    from dflash_train.eval.acceptance import timed
    from dflash_train.model.dflash import StepClock

    device = model.device
    clock = StepClock(device) if time_steps else NO_CLOCK
    torch.manual_seed(seed)
    spec, spec_s = timed(lambda: spec_generate_batch(drafter, model, prompts, max_new_tokens, Sampling(temperature),
                                                      stop_token_ids, clock=clock, verify_tokens=verify_tokens),
                         device)
    torch.manual_seed(seed)
    gaps = [[] for _ in prompts]
    plain, plain_s = timed(lambda: target_generate_batch(model, prompts, max_new_tokens, stop_token_ids,
                                                          temperature, gaps), device)
    return batch_results(prompt_ids, prompts, (spec, spec_s), (plain, plain_s), max_new_tokens, stop_token_ids, turn,
                         gaps)


def batch_results(prompt_ids: list[str], prompts: list[list[int]], spec: tuple, plain: tuple, max_new_tokens: int,
                  stop_token_ids, turn: int, gaps: list[list[float]] | None = None) -> list:
    """One `PromptResult` per row of a batch decoded both ways: ``spec`` (SpecOutputs, seconds),
    ``plain`` (new tokens per row, seconds). Each row's time is its share of the batch's."""
    from dflash_train.eval.acceptance import PromptResult, trim_output

    (outs, spec_s), (news, plain_s) = spec, plain
    share = 1 / len(prompts)
    step_times = None
    if outs[0].step_times is not None:  # the batch's decode steps: as many as its longest-running row took
        steps = max(len(out.acceptance_lengths) for out in outs)
        step_times = {**{k: v * share for k, v in outs[0].step_times.items()}, "steps": steps * share}
    gaps = gaps or [[] for _ in prompts]
    return [PromptResult(id=pid, prompt_tokens=len(p), acceptance_lengths=out.acceptance_lengths,
                         spec_ids=trim_output(out.output_ids[0, len(p):].tolist(), max_new_tokens, stop_token_ids),
                         plain_ids=trim_output(new, max_new_tokens, stop_token_ids), spec_s=spec_s * share,
                         plain_s=plain_s * share, plain_gaps_ulps=g, turn=turn, step_times=step_times)
            for pid, p, out, new, g in zip(prompt_ids, prompts, outs, news, gaps)]
