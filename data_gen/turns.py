"""Every turn regenerated: conversations answered turn by turn on the target's own history,
scheduled so that a conversation's next turn goes into the very next `generate` call.

The pipeline hands this module the shards of one rank. Conversations of the oldest open
shards come first; when fewer turns are ready than a call takes, the next shard opens, so
turn 3 of one conversation shares a call with turn 1 of others and no call waits for a whole
shard to finish a turn. A shard is returned (and then committed by the caller) once all its
conversations have ended; its rows depend only on its prompts and the settings, because
every prompt samples from its own seed (run seed, prompt id, turn), whatever call it lands in.

A budget (a deadline) ends the schedule early: after it no shard opens and no turn is asked,
the answers of the call in flight finish, and every open shard in which some conversation
has begun is returned, each conversation ending at its last answer. Such a shard holds
fewer turns than its prompts would give; its metadata counts them (`budget_cut`).
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator

from data_gen.config import DatagenConfig
from data_gen.generators import SEED_DIGEST, Failure, GeneratorUnavailable, past
from data_gen.sources import SkipLog, SourcePrompt
from data_gen.template import ChatShaper
from dflash_train.contract import derive_seed


@dataclass
class _Conversation:
    prompt: SourcePrompt
    answers: list[list[int]] = field(default_factory=list)
    # The pending turn's prompt (ids, mask); None once the conversation has ended.
    pending: tuple[list[int], list[int]] | None = None
    # The last completed turn: (prompt ids, prompt mask, response ids, finish reason).
    row: tuple | None = None
    tokens: int = 0
    retokenized: int = 0


@dataclass
class _Shard:
    index: int
    convs: list[_Conversation]
    skips: SkipLog = field(default_factory=SkipLog)  # conversations without a single answer
    ended: SkipLog = field(default_factory=SkipLog)  # conversations that stopped before their last turn
    open: int = 0
    cut: int = 0  # conversations the budget ended (or kept from starting)


def turn_seed(seed: int, prompt: SourcePrompt, turn: int) -> int:
    """A prompt's own sampling seed for one turn: the same in any batch, shard or rank."""
    return derive_seed(seed, prompt.prompt_id, turn, digest=SEED_DIGEST)


def _next_turn(cfg: DatagenConfig, shaper: ChatShaper, shard: _Shard, c: _Conversation) -> bool:
    """Set the conversation's next prompt; False (and the reason recorded) when it ends here."""
    c.pending = None
    if len(c.answers) == len(c.prompt.user_turns):
        return False
    try:
        ids, mask = shaper.prompt(c.prompt.system, c.prompt.user_turns, c.answers)
    except Exception as e:  # a later turn the template refuses (jinja raise_exception) ends it
        shard.ended.add(f"template_error: {type(e).__name__}")
        return False
    if len(ids) > cfg.max_prompt_len:
        # Its earlier turns stay: the row keeps what fits, and the trainer cuts a row
        # longer than data.max_length there.
        shard.ended.add("too_long")
        return False
    c.pending = (ids, mask)
    return True


def _goes_on(cfg: DatagenConfig, shaper: ChatShaper, shard: _Shard, c: _Conversation, finish: str) -> bool:
    """Whether the conversation goes on to its next turn after an answer that ended with
    ``finish``. A cut-off answer is not a history the target would continue from: with turns
    left, the conversation ends early there (counted under the limit that cut it)."""
    if finish != "stop":
        if len(c.answers) < len(c.prompt.user_turns):
            shard.ended.add("max_new_tokens" if finish == "length" else f"finish_{finish}")
        return False
    return _next_turn(cfg, shaper, shard, c)


def _record(shard: _Shard, c: _Conversation, result) -> None:
    if isinstance(result, Failure):
        (shard.skips if c.row is None else shard.ended).add("backend_error", f"{c.prompt.prompt_id}: {result.detail}")
        c.pending = None
        return
    ids, mask = c.pending
    c.tokens += len(result.ids)
    c.retokenized += not result.exact_ids
    c.answers.append(result.ids)
    c.row = (ids, mask, result.ids, result.finish_reason)


def _cut(shard: _Shard, c: _Conversation) -> None:
    """The budget ran out before the conversation's next turn started: it ends at its last
    answer, or is no row at all without one."""
    c.pending = None
    shard.cut += 1
    if c.row is None:
        shard.skips.add("budget", f"{c.prompt.prompt_id}: not started before the budget ran out")
    else:
        shard.ended.add("budget")


def _row(c: _Conversation) -> dict:
    """The training row of a conversation: its last prompt (the earlier answers inside it are
    learned too, template.py) plus the target's last answer."""
    ids, mask, response, finish = c.row
    return {"input_ids": ids + response, "loss_mask": mask + [1] * len(response), "prompt_id": c.prompt.prompt_id,
            "source": c.prompt.source, "finish_reason": finish, "prompt_len": len(ids),
            "response_len": len(response), "num_tokens": len(ids) + len(response)}


def _finish(shard: _Shard) -> tuple[list[dict], dict]:
    rows = [_row(c) for c in shard.convs if c.row is not None]
    meta = {"shard": shard.index, "prompt_ids": [c.prompt.prompt_id for c in shard.convs],
            "generated_tokens": sum(c.tokens for c in shard.convs),
            "retokenized": sum(c.retokenized for c in shard.convs), "skipped": dict(shard.skips.counts),
            "skipped_examples": shard.skips.examples, "ended_early": dict(shard.ended.counts),
            "finish_reasons": dict(Counter(r["finish_reason"] for r in rows)), "rows": len(rows),
            "tokens": sum(r["num_tokens"] for r in rows), "response_tokens": sum(r["response_len"] for r in rows)}
    if shard.cut:
        meta["budget_cut"] = shard.cut
    return rows, meta


def generate_shards(cfg: DatagenConfig, shaper: ChatShaper, generator, shards: dict[int, list[SourcePrompt]],
                    call_size: int, deadline: float | None = None) -> Iterator[tuple[int, list[dict], dict]]:
    """(index, rows, metadata) of each shard of `shards` (index -> prompts) as it completes,
    or as the budget ends it (``deadline``, a time.monotonic() value; the module says how).

    Raises GeneratorUnavailable on a retryable failure: the open shards stay uncommitted."""
    waiting = sorted(shards)
    active: dict[int, _Shard] = {}
    ready: list[tuple[int, int]] = []  # heap of (shard, position): the oldest shard's turns go first
    while waiting or active:
        if past(deadline):
            yield from _end_by_budget(active, ready)
            return
        while waiting and len(ready) < call_size:
            k = waiting.pop(0)
            shard = active[k] = _Shard(k, [_Conversation(p) for p in shards[k]])
            for pos, c in enumerate(shard.convs):
                if _next_turn(cfg, shaper, shard, c):
                    heapq.heappush(ready, (k, pos))
                    shard.open += 1
        calls = [heapq.heappop(ready) for _ in range(min(call_size, len(ready)))]
        convs = [(active[k], active[k].convs[pos]) for k, pos in calls]
        if convs:
            results = generator.generate([c.pending[0] for _, c in convs],
                                         [turn_seed(cfg.sampling.seed, c.prompt, len(c.answers)) for _, c in convs],
                                         deadline=deadline)
            retry = [(k, r.detail) for (k, _), r in zip(calls, results) if isinstance(r, Failure) and r.retryable]
            if retry:
                where = ", ".join(str(k) for k in sorted({k for k, _ in retry}))
                raise GeneratorUnavailable(f"shard {where}: {len(retry)} prompts failed, e.g. {retry[0][1]}")
            for (shard, c), (k, pos), r in zip(convs, calls, results):
                if r is None:  # not started: the budget ran out during the call
                    _cut(shard, c)
                    shard.open -= 1
                    continue
                _record(shard, c, r)
                if c.pending is not None and _goes_on(cfg, shaper, shard, c, r.finish_reason):
                    heapq.heappush(ready, (k, pos))
                else:
                    shard.open -= 1
        yield from _done(active, [k for k, s in active.items() if s.open == 0])


def _done(active: dict[int, _Shard], ended: list[int]) -> Iterator[tuple[int, list[dict], dict]]:
    """The ended shards, out of ``active``; one the budget ended before any of its
    conversations began is left unwritten, for a later run."""
    for k in ended:
        shard = active.pop(k)
        if not shard.cut or any(c.row is not None for c in shard.convs):
            yield k, *_finish(shard)


def _end_by_budget(active: dict[int, _Shard], ready: list[tuple[int, int]]) -> Iterator[tuple[int, list[dict], dict]]:
    """Every open shard, its waiting turns cut."""
    for k, pos in ready:
        _cut(active[k], active[k].convs[pos])
    yield from _done(active, sorted(active))
