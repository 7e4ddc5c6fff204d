"""Every turn regenerated: conversations answered turn by turn on the target's own history,
scheduled so that a conversation's next turn is asked as soon as its answer ends.

The pipeline hands this module the shards of one rank. Shards open in order, as many as keep
`lookahead` conversations open (and more while fewer turns are ready than the generator
takes), so turn 3 of one conversation runs beside turn 1 of others and nothing waits for a
whole shard to finish a turn. Among the turns ready, a conversation's next turn goes first,
then the conversation with the most user turns starts (then the oldest shard's): its answers
must come one after another, so it is the job's critical path, and started last it would run
almost alone in the slots at the end (issue 39's every-turn job on one H100: 58% of the
engine's slots live in a mean step; `python -m benchmarks.turn_schedule` models it). With one
turn each (`template.max_turns=1`) the order is the shards'. Two schedules share that order and
the bookkeeping:
  * streamed, for a generator that answers as its slots free (the engine: `streams`, `wanted`,
    `submit`, `drain`, `unstarted`): it is fed as many turns as its free slots take, and the
    moment an answer ends the conversation's next turn is queued, so the engine never drains
    until the work (or the budget) ends;
  * in calls, for the others (hf, openai): a conversation's next turn goes into the very next
    `generate` call.
A shard is returned (and then committed by the caller) once all its conversations have ended;
its rows depend only on its prompts and the settings, because every prompt samples from its
own seed (run seed, prompt id, turn), whatever call, slot or moment it runs in.

A budget (a deadline) ends the schedule early: after it no shard opens and no turn is asked,
the answers in flight finish, and every open shard in which some conversation has begun is
returned, each conversation ending at its last answer (a turn queued but not started when the
deadline passed is cut too). Such a shard holds fewer turns than its prompts would give; its
metadata counts them (`budget_cut`).
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
    texts: list[str] = field(default_factory=list)  # the answers as the chat holds them, once decoded
    # The pending turn's prompt ids; None once the conversation has ended.
    pending: list[int] | None = None
    # The last completed turn: (prompt ids, response ids, finish reason). Its prompt's loss mask
    # is built as the row is written (_row): asking a turn needs the ids alone, and of all the
    # prompts a conversation asks, the row keeps the last one's mask.
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
    texts = _texts(shaper, c, len(c.answers))
    try:
        ids = shaper.prompt_ids(c.prompt.system, c.prompt.user_turns, texts)
    except Exception as e:  # a later turn the template refuses (jinja raise_exception) ends it
        shard.ended.add(f"template_error: {type(e).__name__}")
        return False
    if len(ids) > cfg.max_prompt_len:
        # Its earlier turns stay: the row keeps what fits, and the trainer cuts a row
        # longer than data.max_length there.
        shard.ended.add("too_long")
        return False
    c.pending = ids
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
    c.tokens += len(result.ids)
    c.retokenized += not result.exact_ids
    c.answers.append(result.ids)
    c.row = (c.pending, result.ids, result.finish_reason)


def _cut(shard: _Shard, c: _Conversation) -> None:
    """The budget ran out before the conversation's next turn started: it ends at its last
    answer, or is no row at all without one."""
    c.pending = None
    shard.cut += 1
    if c.row is None:
        shard.skips.add("budget", f"{c.prompt.prompt_id}: not started before the budget ran out")
    else:
        shard.ended.add("budget")


def _texts(shaper: ChatShaper, c: _Conversation, n: int) -> list[str]:
    """The first n answers as the chat holds them, each decoded once a conversation."""
    c.texts += [shaper.answer_text(a) for a in c.answers[len(c.texts):n]]
    return c.texts[:n]


def _prompt(shaper: ChatShaper, c: _Conversation, turn: int) -> tuple[list[int], list[int]]:
    """Ids and loss mask of the conversation's prompt for user turn `turn` (0-based)."""
    return shaper.prompt(c.prompt.system, c.prompt.user_turns, c.answers[:turn], texts=_texts(shaper, c, turn))


def _row(shaper: ChatShaper, shard: _Shard, c: _Conversation) -> dict:
    """The training row of a conversation: its last prompt (the earlier answers inside it are
    learned too, template.py) plus the target's last answer.

    Its prompt was asked with its ids alone; its mask is built here. A template that renders a
    turn but cannot mask it ends the conversation where asking with the mask would have: at
    the first such turn, the row being the turn before it (the turns asked after it were
    generated, and count in the shard's tokens)."""
    ids, response, finish = c.row
    last = len(c.answers) - 1
    try:
        full, mask = _prompt(shaper, c, last)
    except Exception as e:
        shard.ended.add(f"template_error: {type(e).__name__}")
        last = next(t for t in range(1, last + 1) if _unmasked(shaper, c, t)) - 1
        (ids, mask), response, finish = _prompt(shaper, c, last), c.answers[last], "stop"
    else:
        if full != ids:  # one rendering, tokenized twice: never seen; a row must not hold it
            raise RuntimeError(f"prompt {c.prompt.prompt_id!r}, turn {last}: its ids changed between asking "
                               "the turn and writing its row")
    return {"input_ids": ids + response, "loss_mask": mask + [1] * len(response), "prompt_id": c.prompt.prompt_id,
            "source": c.prompt.source, "finish_reason": finish, "prompt_len": len(ids),
            "response_len": len(response), "num_tokens": len(ids) + len(response)}


def _unmasked(shaper: ChatShaper, c: _Conversation, turn: int) -> bool:
    try:
        _prompt(shaper, c, turn)
    except Exception:
        return True
    return False


def _finish(shaper: ChatShaper, shard: _Shard) -> tuple[list[dict], dict]:
    rows = [_row(shaper, shard, c) for c in shard.convs if c.row is not None]
    meta = {"shard": shard.index, "prompt_ids": [c.prompt.prompt_id for c in shard.convs],
            "generated_tokens": sum(c.tokens for c in shard.convs),
            "retokenized": sum(c.retokenized for c in shard.convs), "skipped": dict(shard.skips.counts),
            "skipped_examples": shard.skips.examples, "ended_early": dict(shard.ended.counts),
            "finish_reasons": dict(Counter(r["finish_reason"] for r in rows)), "rows": len(rows),
            "tokens": sum(r["num_tokens"] for r in rows), "response_tokens": sum(r["response_len"] for r in rows)}
    if shard.cut:
        meta["budget_cut"] = shard.cut
    return rows, meta


class _Schedule:
    """The bookkeeping both schedules share: the open shards, the turns ready to be asked (the
    next turns of conversations begun, then the conversations with the most turns, then the
    oldest shard's), and what an answer does to its conversation. A turn is named by its key
    (shard, position in the shard)."""

    def __init__(self, cfg: DatagenConfig, shaper: ChatShaper, shards: dict[int, list[SourcePrompt]],
                 lookahead: int):
        self.cfg, self.shaper, self.shards, self.lookahead = cfg, shaper, shards, lookahead
        self.waiting = sorted(shards)
        self.active: dict[int, _Shard] = {}
        self.open = 0  # conversations of the open shards that have not ended
        # heap of (not begun, -turns left, shard, position): a conversation's next turn first,
        # then the longest chain of answers still to start
        self.ready: list[tuple[int, int, int, int]] = []

    def _push(self, key: tuple[int, int]) -> None:
        c = self.active[key[0]].convs[key[1]]
        heapq.heappush(self.ready, (int(not c.answers), len(c.answers) - len(c.prompt.user_turns), *key))

    def _ended(self, shard: _Shard) -> None:
        shard.open -= 1
        self.open -= 1

    def take(self, n: int) -> list[tuple[int, int]]:
        """Up to n ready turns, opening the next shards while fewer than `lookahead`
        conversations are open or fewer than n turns are ready."""
        while self.waiting and (self.open < self.lookahead or len(self.ready) < n):
            k = self.waiting.pop(0)
            shard = self.active[k] = _Shard(k, [_Conversation(p) for p in self.shards[k]])
            for pos, c in enumerate(shard.convs):
                if _next_turn(self.cfg, self.shaper, shard, c):
                    shard.open += 1
                    self.open += 1
                    self._push((k, pos))
        return [heapq.heappop(self.ready)[2:] for _ in range(min(n, len(self.ready)))]

    def prompt(self, key: tuple[int, int]) -> tuple[list[int], int]:
        """The turn's prompt ids and its own sampling seed."""
        c = self.active[key[0]].convs[key[1]]
        return c.pending, turn_seed(self.cfg.sampling.seed, c.prompt, len(c.answers))

    def answer(self, key: tuple[int, int], result) -> None:
        """Record the turn's result (None: the budget kept it from starting); its conversation
        goes on (its next turn ready) or ends."""
        shard = self.active[key[0]]
        c = shard.convs[key[1]]
        if result is None:
            _cut(shard, c)
            self._ended(shard)
            return
        _record(shard, c, result)
        if c.pending is not None and _goes_on(self.cfg, self.shaper, shard, c, result.finish_reason):
            self._push(key)
        else:
            self._ended(shard)

    def finished(self) -> Iterator[tuple[int, list[dict], dict]]:
        """The shards whose conversations have all ended, out of the schedule."""
        yield from _done(self.shaper, self.active, [k for k, s in self.active.items() if s.open == 0])

    def end_by_budget(self) -> Iterator[tuple[int, list[dict], dict]]:
        """Every open shard, its ready turns cut."""
        for *_, k, pos in self.ready:
            _cut(self.active[k], self.active[k].convs[pos])
        self.ready = []
        yield from _done(self.shaper, self.active, sorted(self.active))


def generate_shards(cfg: DatagenConfig, shaper: ChatShaper, generator, shards: dict[int, list[SourcePrompt]],
                    call_size: int, deadline: float | None = None,
                    lookahead: int | None = None) -> Iterator[tuple[int, list[dict], dict]]:
    """(index, rows, metadata) of each shard of `shards` (index -> prompts) as it completes,
    or as the budget ends it (``deadline``, a time.monotonic() value; the module says how).
    A generator that streams (the engine) is fed turn by turn; any other is called with up
    to `call_size` turns at a time. Shards open while fewer than `lookahead` conversations
    are open (default `call_size`: the pipeline's calls hold many batches, generators.py).

    Raises GeneratorUnavailable on a retryable failure: the open shards stay uncommitted."""
    schedule = _Schedule(cfg, shaper, shards, call_size if lookahead is None else lookahead)
    if getattr(generator, "streams", False):
        yield from _stream(schedule, generator, deadline)
    else:
        yield from _calls(schedule, generator, call_size, deadline)


def _calls(schedule: _Schedule, generator, call_size: int, deadline: float | None):
    """Turns in calls: a conversation's next turn goes into the call after its answer's."""
    while schedule.waiting or schedule.active:
        if past(deadline):
            yield from schedule.end_by_budget()
            return
        keys = schedule.take(call_size)
        if keys:
            prompts, seeds = zip(*map(schedule.prompt, keys))
            results = generator.generate(list(prompts), list(seeds), deadline=deadline)
            _raise_retryable(list(zip(keys, results)))
            for key, r in zip(keys, results):
                schedule.answer(key, r)
        yield from schedule.finished()


def _stream(schedule: _Schedule, generator, deadline: float | None):
    """Turns streamed through a generator that answers as its slots free (the engine): it is
    kept fed with as many turns as its free slots take, and as each answer ends, the
    conversation's next turn is queued at once, so the generator never drains before the
    work (or the budget) ends. Queued turns the deadline kept out come back unstarted."""

    def feed() -> None:
        if not past(deadline):
            for key in schedule.take(generator.wanted()):
                generator.submit(key, *schedule.prompt(key))

    feed()
    for key, result in generator.drain(deadline):
        _raise_retryable([(key, result)])
        schedule.answer(key, result)
        feed()
        yield from schedule.finished()
    for key in generator.unstarted():
        schedule.answer(key, None)
    yield from schedule.end_by_budget() if past(deadline) else schedule.finished()
    # Without the budget the drain ends only once no turn is ready and no shard is waiting.
    assert not schedule.active, f"shards {sorted(schedule.active)} left with turns unanswered"


def _raise_retryable(results: list[tuple[tuple[int, int], object]]) -> None:
    retry = [(k, r.detail) for (k, _), r in results if isinstance(r, Failure) and r.retryable]
    if retry:
        where = ", ".join(str(k) for k in sorted({k for k, _ in retry}))
        raise GeneratorUnavailable(f"shard {where}: {len(retry)} prompts failed, e.g. {retry[0][1]}")


def _done(shaper: ChatShaper, active: dict[int, _Shard],
          ended: list[int]) -> Iterator[tuple[int, list[dict], dict]]:
    """The ended shards, out of ``active``; one the budget ended before any of its
    conversations began is left unwritten, for a later run."""
    for k in ended:
        shard = active.pop(k)
        if not shard.cut or any(c.row is not None for c in shard.convs):
            yield k, *_finish(shaper, shard)
