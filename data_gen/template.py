"""Conversation shaping with the target's own chat template, and the assistant loss mask.

A training row is `prompt_ids + response_ids`: the prompt is the template rendering of the
system prompt, the earlier turns (with the target's own earlier answers as the assistant
messages: on-policy history) and the generation prompt; the response is the token ids the
target generated for the last user turn, learned in full (mask 1, stop token included).

Inside the prompt, the earlier assistant turns are learned too. Their tokens come from one
of two exact sources:
  * the template's `{% generation %}` markers, when it has them (HF's assistant mask);
  * otherwise, the template itself: the turn is rendered twice with two different sentinel
    contents, and the characters where the two renderings differ are where that turn's
    content sits; the mask covers that content and the stop token that follows it. This
    holds for templates that rewrite history (Qwen3 drops earlier reasoning) because the
    sentinels go through the same template code as the real content.
"""

from __future__ import annotations

import bisect
import re
from pathlib import Path

from dflash_train.model.target import template_sha256

# Differ in their first and last character, so the common prefix / suffix of the two
# renderings ends exactly at the content boundaries.
SENTINELS = ("<<dflash-a>>", "[[dflash-b]]")
GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


# Tokenized pieces of rendered text (between added tokens) a shaper keeps (ChatShaper._piece_ids),
# with their character spans, and how many of its first `ids` and `encode` calls it checks against
# tokenizing the text whole.
PIECE_CACHE = 1 << 16
PIECE_CHECKS = 64


def _common_prefix(a: str, b: str) -> int:
    """The length of a's and b's common prefix: a binary search of slice comparisons (each a
    C memcmp; a loop over the characters took a third of a row's mask)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_suffix(a: str, b: str) -> int:
    return _common_prefix(a[::-1], b[::-1])


def _within(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token (start, end) inside one of `spans` (character ranges in order, none
    overlapping), else 0: the span that may hold it is the last starting at or before it."""
    starts = [a for a, _ in spans]
    mask = []
    for s, e in offsets:
        i = bisect.bisect_right(starts, s) - 1
        mask.append(int(i >= 0 and e <= spans[i][1]))
    return mask


def _splitter(tokenizer) -> re.Pattern | None:
    """A pattern splitting text at the tokenizer's added tokens (captured), when tokenizing a
    text is tokenizing its pieces between them one by one: a fast tokenizer splits at added
    tokens matched on the raw text (not normalized, no whitespace stripped around them, not
    whole words only) before anything else. None otherwise."""
    if not getattr(tokenizer, "is_fast", False):
        return None
    added = list(tokenizer.added_tokens_decoder.values())
    if not added or any(t.lstrip or t.rstrip or t.single_word or t.normalized for t in added):
        return None
    contents = sorted({t.content for t in added}, key=len, reverse=True)  # the longest match first
    return re.compile("(" + "|".join(map(re.escape, contents)) + ")")


class ChatShaper:
    """Renders conversations with one tokenizer, template and thinking setting."""

    def __init__(self, tokenizer, stop_ids: list[int], enable_thinking: bool | None = None,
                 system_prompt: str | None = None, chat_template: str | None = None):
        # An override is passed to every call, never set on the (possibly shared) tokenizer.
        if chat_template is not None:
            path = Path(chat_template)
            if not path.is_file():
                raise ValueError(f"template.chat_template={chat_template!r}: no such file")
            template = path.read_text(encoding="utf-8")
        else:
            template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no chat template: "
                             "set template.chat_template to a Jinja file")
        if not isinstance(template, str):
            raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has several named chat templates "
                             f"{sorted(template)}: set template.chat_template to the one to use")
        if enable_thinking is not None and "enable_thinking" not in template:
            raise ValueError(f"template.enable_thinking={enable_thinking} but the chat template of "
                             f"{tokenizer.name_or_path!r} has no enable_thinking switch: set it to null")
        self.tokenizer = tokenizer
        self.template = template
        self.stop_ids = stop_ids
        self.stop_strings = [tokenizer.convert_ids_to_tokens(i) for i in stop_ids]
        self.enable_thinking = enable_thinking
        self.system_prompt = system_prompt
        self.uses_markers = bool(GENERATION_MARKER.search(template))
        # `ids` tokenizes a rendering a piece between added tokens at a time, each piece once
        # (a conversation's next turn repeats all of its history): its first PIECE_CHECKS calls
        # are checked against the whole text's tokens, and a difference turns the pieces off.
        self._split = _splitter(tokenizer)
        self._added = {t.content: i for i, t in tokenizer.added_tokens_decoder.items()} if self._split else {}
        self._piece_ids: dict[str, list[int]] = {}
        self._checks = PIECE_CHECKS
        # the renderings of the first prompts `prime` saw last, by (system, first user turn):
        # each prompt's first `prompt_ids` takes its own instead of rendering it again
        self._primed: dict[tuple[str | None, str], str] = {}

    @property
    def settings(self) -> dict:
        return {
            "enable_thinking": self.enable_thinking,
            "system_prompt": self.system_prompt,
            "chat_template_sha256": template_sha256(self.template),
            "mask_method": "generation_markers" if self.uses_markers else "sentinel_diff",
            "stop_token_ids": self.stop_ids,
        }

    def messages(self, system: str | None, user_turns, answers: list[str]) -> list[dict]:
        """Chat messages: system (configured one first), then user/assistant pairs."""
        system = self.system_prompt if self.system_prompt is not None else system
        msgs = [{"role": "system", "content": system}] if system is not None else []
        for i, user in enumerate(user_turns):
            msgs.append({"role": "user", "content": user})
            if i < len(answers):
                msgs.append({"role": "assistant", "content": answers[i]})
        return msgs

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self._kwargs())

    def _kwargs(self) -> dict:
        kwargs = {"chat_template": self.template}
        if self.enable_thinking is not None:
            kwargs["enable_thinking"] = self.enable_thinking
        return kwargs

    def answer_text(self, response_ids: list[int]) -> str:
        """An assistant message's content as the served chat would hold it: no stop token."""
        if response_ids and response_ids[-1] in self.stop_ids:
            response_ids = response_ids[:-1]
        return self.tokenizer.decode(response_ids, skip_special_tokens=False)

    def _learned_spans(self, messages: list[dict], text: str, add_generation_prompt: bool) -> list[tuple[int, int]]:
        """Character spans of `text` holding what the target wrote for each assistant turn."""
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            a, b = (self.render([*messages[:i], {**m, "content": s}, *messages[i + 1:]], add_generation_prompt)
                    for s in SENTINELS)
            pre, suf = _common_prefix(a, b), _common_suffix(a, b)
            # Everything after the content renders the same for any content.
            end = len(text) - suf
            generation_prompt = self.render(messages[:i], add_generation_prompt=True)
            if text.startswith(generation_prompt):
                # The turn continues the generation prompt: all of it is the target's output,
                # including any reasoning the template shows (Qwen3, last turn).
                start = len(generation_prompt)
            elif text.startswith(a[:pre]):
                # The template rewrites this turn in history (Qwen3 drops reasoning and the
                # empty think block): only the content it keeps is the target's.
                start = pre
            else:
                raise ValueError(f"chat template: assistant turn {i} renders unlike its generation prompt "
                                 "and unlike a plain content slot; cannot build its loss mask")
            if not text.endswith(a[len(a) - suf:]) or start > end:
                raise ValueError(f"chat template: the text after assistant turn {i} depends on its content; "
                                 "cannot build its loss mask")
            # The stop token the target emitted after the content, when the template shows it.
            stops = [(text.find(stop, end), stop) for stop in self.stop_strings]
            stops = [(pos, stop) for pos, stop in stops if pos >= 0 and not text[end:pos].strip()]
            if stops:
                pos, stop = min(stops)
                end = pos + len(stop)
            spans.append((start, end))
        return spans

    def ids(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        """`encode`'s input_ids alone, without building the mask (one rendering, no offsets)."""
        if self.uses_markers:
            out = self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                     add_generation_prompt=add_generation_prompt, **self._kwargs())
            return list(out["input_ids"])
        return self._tokens(self.render(messages, add_generation_prompt))

    def _tokens(self, text: str, offsets: bool = False):
        """The text's ids (with `offsets`: and each token's character span, as a pair of lists),
        by pieces while they are on; a checked call that differs turns them off."""
        if self._split is None:
            return self._whole(text, offsets)
        got = self._by_pieces(text, offsets)
        if self._checks > 0:
            self._checks -= 1
            whole = self._whole(text, offsets)
            if whole != got:
                self._split = None
                return whole
        return got

    def _whole(self, text: str, offsets: bool = False):
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=offsets)
        ids = list(enc["input_ids"])
        return (ids, [tuple(o) for o in enc["offset_mapping"]]) if offsets else ids

    def _by_pieces(self, text: str, offsets: bool = False):
        """`_whole` a piece between added tokens at a time, each piece's tokens and spans
        tokenized once (the spans relative to the piece, shifted to where it sits)."""
        ids, spans, at = [], [], 0
        for i, piece in enumerate(self._split.split(text)):
            if i % 2:  # an added token
                ids.append(self._added[piece])
                if offsets:
                    spans.append((at, at + len(piece)))
            elif piece:
                got = self._piece_ids.get(piece)
                if got is None:
                    self._cache_pieces([piece])
                    got = self._piece_ids[piece]
                ids.extend(got[0])
                if offsets:
                    spans.extend((at + s, at + e) for s, e in got[1])
            at += len(piece)
        return (ids, spans) if offsets else ids

    def prime(self, first_turns: list[tuple[str | None, str]]) -> None:
        """Tokenize in one call the pieces of these first prompts (system prompt, first user turn)
        that the piece cache lacks, so that each one's `prompt_ids` finds its pieces there: one
        batch for many prompts (the fast tokenizer encodes a batch on every core) instead of a
        call each. Cache only: ids and spans are `_whole`'s for each piece. Nothing while the
        pieces are off; a prompt whose template raises is left to `prompt_ids` to report. Each
        rendering is kept until the next call, for that prompt's first `prompt_ids`."""
        self._primed.clear()
        if self._split is None or self.uses_markers:
            return
        todo: dict[str, None] = {}
        for system, user in first_turns:
            try:
                text = self.render(self.messages(system, (user,), []), add_generation_prompt=True)
            except Exception:  # a template raising: the fit check reports it
                continue
            self._primed[system, user] = text
            for i, piece in enumerate(self._split.split(text)):
                if not i % 2 and piece and piece not in self._piece_ids:
                    todo[piece] = None
        if todo:
            self._cache_pieces(list(todo))

    def _cache_pieces(self, pieces: list[str]) -> None:
        """Each piece's ids and character spans (`_whole`'s) into the piece cache, all in one call
        of the tokenizer; a cache that would pass PIECE_CACHE is emptied first."""
        if len(self._piece_ids) + len(pieces) > PIECE_CACHE:
            self._piece_ids.clear()
        enc = self.tokenizer(pieces, add_special_tokens=False, return_offsets_mapping=True)
        for piece, ids, spans in zip(pieces, enc["input_ids"], enc["offset_mapping"], strict=True):
            self._piece_ids[piece] = (list(ids), [tuple(o) for o in spans])

    def encode(self, messages: list[dict], add_generation_prompt: bool) -> tuple[list[int], list[int]]:
        """(input_ids, loss_mask) of a rendered conversation; mask 1 on assistant turns."""
        if self.uses_markers:
            out = self.tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                add_generation_prompt=add_generation_prompt, **self._kwargs())
            return list(out["input_ids"]), [int(x) for x in out["assistant_masks"]]
        text = self.render(messages, add_generation_prompt)
        ids, offsets = self._tokens(text, offsets=True)  # by pieces: a row's text is mostly its asked turns'
        return ids, _within(offsets, self._learned_spans(messages, text, add_generation_prompt))

    def prompt(self, system: str | None, user_turns, answers: list[list[int]],
               texts: list[str] | None = None) -> tuple[list[int], list[int]]:
        """Prompt ids and mask for the turn after `answers` (the target's earlier responses;
        `texts`: their `answer_text`s, when the caller has them already)."""
        texts = [self.answer_text(a) for a in answers] if texts is None else texts
        return self.encode(self.messages(system, user_turns[: len(answers) + 1], texts), add_generation_prompt=True)

    def prompt_ids(self, system: str | None, user_turns, texts: list[str]) -> list[int]:
        """`prompt`'s ids alone, after the earlier answers' `answer_text`s (a turn being asked:
        the mask is needed only for the turn a training row keeps, data_gen/turns.py)."""
        if not texts and self._primed:  # a first prompt `prime` rendered: its text, taken once
            text = self._primed.pop((system, user_turns[0]), None)
            if text is not None:
                return self._tokens(text)
        return self.ids(self.messages(system, user_turns[: len(texts) + 1], texts), add_generation_prompt=True)

