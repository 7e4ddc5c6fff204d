"""GPU: the engine's CUDA graphs replay what its eager decode steps and prefill forwards compute
(the eager engine runs the graphs' bucketed prefill shapes), on every attention width, with
either decode attention (sdpa; flex, compiled, its BlockMask built inside the graph), the two
give the same answers, and on SmolLM2 in float32 its answers equal the hf generator's (as on
CPU).

A decode step that reads a Python value at capture time, syncs with the host, or a buffer
that moves after capture shows up here as different tokens or a capture error.
"""

import copy

import pytest
import torch

from data_gen.config import BackendConfig, SamplingConfig
from data_gen.engine import WIDTH_STEP, EngineGenerator
from data_gen.hf_generator import HFGenerator
from data_gen.template import ChatShaper
from dflash_train.model.target import TargetModel
from tests.conftest import make_tiny_target

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
MAX_NEW, MAX_PROMPT = 40, 2 * WIDTH_STEP
STOP = 3


def _engine(target, graphs: bool, batch_size: int = 4, attention: str = "sdpa", compile: bool = False,
            prefill: str = "padded", region: str = "model", **sampling):
    cfg = BackendConfig(kind="engine", batch_size=batch_size, cuda_graphs=graphs, attention=attention, compile=compile,
                        prefill=prefill, compile_region=region)
    return EngineGenerator(target, cfg, SamplingConfig(max_new_tokens=MAX_NEW, **sampling), [STOP], MAX_PROMPT,
                           buckets=True)


@pytest.fixture(scope="module")
def tiny():
    """A random Qwen2-shaped target with a small vocabulary, so answers hit the stop token."""
    return TargetModel(make_tiny_target("qwen2", vocab=11, layers=3).cuda())


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    lengths = [1, 7, 300, 33, MAX_PROMPT, 5, 129, 480, 2, 64, 250, 17]  # widths 256, 512 and the last one
    return [torch.randint(4, 11, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.9}])
def test_graphs_replay_the_eager_steps(tiny, prompts, sampling, attention):
    seeds = list(range(len(prompts)))
    graphs = _engine(tiny, True, attention=attention, **sampling)
    eager = _engine(tiny, False, attention=attention, **sampling)
    got, want = graphs.generate(prompts, seeds), eager.generate(prompts, seeds)
    widths = [WIDTH_STEP, 2 * WIDTH_STEP, MAX_PROMPT + MAX_NEW] if attention == "sdpa" else [MAX_PROMPT + MAX_NEW]
    assert sorted(graphs.engine.graphs) == widths
    assert [c.ids for c in got] == [c.ids for c in want]
    assert "stop" in {c.finish_reason for c in got}, "slots were refilled"
    again = graphs.generate(prompts[::-1], seeds[::-1])  # a second call replays the same graphs
    assert [c.ids for c in again] == [c.ids for c in got][::-1]


def test_prefill_graphs_write_what_eager_forwards_write(tiny):
    """A prefill shape runs eagerly the first time, is captured the second (after a warm-up run:
    a prefill forward is idempotent) and replayed after; each time the rows hold exactly the
    keys/values of the eager engine's forwards of the same shapes (3 fresh rows padded to 4
    with a copy of the first; 2 rows after kept prefixes)."""
    graphs, eager = _engine(tiny, True).engine, _engine(tiny, False).engine
    prompts = [[5, 6, 7, 8, 9, 10, 4, 4] * 5, [5, 6, 7, 4], [9, 8, 7, 6, 5]]  # the vocabulary is 11 ids
    after = [(1, [5, 6, 7, 8, 9, 10, 6], 3), (2, [9, 8, 7, 6, 5, 4, 5, 6], 4)]
    held = [39, 7, 8]
    with torch.inference_mode():
        for _ in range(3):
            for e in (graphs, eager):
                e._prefill(list(enumerate(prompts)), {})
                e._prefill_after(after)
            for got, want in zip((*graphs.cache_k, *graphs.cache_v), (*eager.cache_k, *eager.cache_v)):
                for row, n in enumerate(held):
                    assert torch.equal(got[row, :, :n], want[row, :, :n])
    assert dict(graphs.prefill_counts) == {"eager": 2, "captured": 2, "replayed": 2}
    assert sorted(graphs.prefill_graphs) == [
        ("fresh", 4, 64), ("kept", 2, 16, 256)]
    assert not eager.prefill_counts and not eager.prefill_graphs


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_prefill_graphs_in_generation_give_the_eager_answers(tiny, prompts, attention):
    """Three calls with the same prompts (the later ones partly served by what the rows kept):
    the eager engine's answers each time, with prefill forwards captured and replayed."""
    seeds = list(range(len(prompts)))
    graphs = _engine(tiny, True, attention=attention)
    want = [c.ids for c in _engine(tiny, False, attention=attention).generate(prompts, seeds)]
    for _ in range(3):
        assert [c.ids for c in graphs.generate(prompts, seeds)] == want
    counts = graphs.engine.prefill_counts
    assert counts["captured"] == len(graphs.engine.prefill_graphs) >= 1 and counts["replayed"] >= 1, counts
    assert counts["eager"] >= counts["captured"], counts


@pytest.mark.parametrize("region", ["model", "layer"])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.9}])
def test_compiled_steps_in_graphs_give_the_eager_answers(tiny, prompts, sampling, region):
    """backend.compile: the flex decode step compiled (whole, or a layer's code for each layer),
    then captured: the eager engine's answers (float32: fused kernels round alike to the last
    bits at most)."""
    seeds = list(range(len(prompts)))
    compiled = _engine(tiny, True, attention="flex", compile=True, region=region, **sampling)
    eager = _engine(tiny, False, attention="flex", **sampling)
    assert [c.ids for c in compiled.generate(prompts, seeds)] == [c.ids for c in eager.generate(prompts, seeds)]
    assert sorted(compiled.engine.graphs) == [MAX_PROMPT + MAX_NEW]


@pytest.mark.parametrize("compile", [False, True])
def test_packed_prefills_in_graphs_give_the_padded_answers(tiny, prompts, compile):
    """backend.prefill=packed in float32 (SDPA under the dense mask: flash attention is half
    precision's): each admission's fresh prompts in one row of a bucketed length, the forwards
    captured and replayed: three calls give the eager padded engine's answers."""
    seeds = list(range(len(prompts)))
    packed = _engine(tiny, True, attention="flex", compile=compile, prefill="packed")
    want = [c.ids for c in _engine(tiny, False, attention="flex").generate(prompts, seeds)]
    for _ in range(3):
        assert [c.ids for c in packed.generate(prompts, seeds)] == want
    e = packed.engine
    fresh = [shape for shape in e.prefill_graphs if shape[0] != "kept"]
    assert fresh and all(shape[0] == "packed" and shape[1] == 1 and shape[2] % 128 == 0 for shape in fresh), fresh
    assert e.prefill_counts["replayed"] >= 1, e.prefill_counts


@pytest.mark.parametrize("longest", [640, 300])
@pytest.mark.parametrize("window", [None, 40])
def test_flash_packed_attention_equals_each_prompt_alone(window, longest):
    """bf16 on a GPU: flash attention's variable-length kernel over a packed row (prompts of 1
    to 300 tokens, the padding a prompt of its own, the bounds ending in empty prompts) gives
    each prompt's causal attention run alone (SDPA), to bf16's rounding, the longest sequence
    given as the row's length or as its longest prompt (Shapes.longest: the grid's rows)."""
    from data_gen.engine_attention import packed_attention, packed_bounds, packed_flash

    torch.manual_seed(0)
    lengths, total = [1, 127, 2, 128, 300, 7, 45], 640
    starts = torch.tensor([sum(lengths[:i]) for i, n in enumerate(lengths) for _ in range(n)]
                          + [sum(lengths)] * (total - sum(lengths)), device="cuda")
    q = torch.randn(1, 14, total, 64, device="cuda", dtype=torch.bfloat16)  # 7 query heads a KV head
    k, v = (torch.randn(1, 2, total, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    assert packed_flash(q)
    out = packed_attention(q, k, v, starts, packed_bounds(starts, 12), longest, window, 0.125, {})
    at = 0
    for n in lengths + [total - sum(lengths)]:
        s = slice(at, at + n)
        t = torch.arange(n, device="cuda")
        causal = (t[None] <= t[:, None]) & ((t[None] > t[:, None] - window) if window else True)
        alone = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, s].float(), k[:, :, s].float().repeat_interleave(7, 1), v[:, :, s].float().repeat_interleave(7, 1),
            attn_mask=causal, scale=0.125)
        assert torch.allclose(out[:, :, s].float(), alone, atol=2e-2), n
        at += n


def test_flash_packed_prefill_in_graphs_writes_the_padded_caches():
    """bf16: a packed prefill (flash attention) captured and replayed writes what the eager
    packed forward writes, exactly, and what the padded prefill writes, to bf16's rounding."""
    target = TargetModel(make_tiny_target("qwen2", vocab=11, layers=3).cuda().to(torch.bfloat16))
    graphs, eager = _engine(target, True, prefill="packed").engine, _engine(target, False, prefill="packed").engine
    padded = _engine(target, False).engine
    prompts = [[5, 6, 7, 8, 9, 10, 4, 4] * 30, [5, 6, 7, 4], [9, 8, 7, 6, 5] * 9]
    held = [239, 3, 44]
    with torch.inference_mode():
        for _ in range(3):
            for e in (graphs, eager, padded):
                e._prefill(list(enumerate(prompts)), {})
            for got, want, near in zip((*graphs.cache_k, *graphs.cache_v), (*eager.cache_k, *eager.cache_v),
                                       (*padded.cache_k, *padded.cache_v)):
                for row, n in enumerate(held):
                    assert torch.equal(got[row, :, :n], want[row, :, :n])
                    assert torch.allclose(got[row, :, :n].float(), near[row, :, :n].float(), atol=5e-2)
    assert dict(graphs.prefill_counts) == {"eager": 1, "captured": 1, "replayed": 1}
    assert sorted(graphs.prefill_graphs) == [("packed", 1, 512)]
    assert _engine(target, True, prefill="auto").engine.prefill == "packed", "auto: packed in bf16 on a GPU"
    assert _engine(tiny_float32(), True, prefill="auto").engine.prefill == "padded", "auto: padded in float32"


@pytest.mark.parametrize("longest", [7, 3])
@pytest.mark.parametrize("window", [None, 3])
def test_flash_kept_attention_equals_each_conversation_alone(window, longest):
    """bf16: next turns packed (3 and 2 new tokens after 5 and 2 held, then padding) through flash
    attention's variable-length kernel, causal from the bottom right: each new token's attention
    over its own conversation's keys up to its position, to bf16's rounding, the longest sequence
    given as the row's 7 new tokens or its longest conversation's 3."""
    from tests.kept_layout import KEYS, assert_each_conversation_alone

    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    q = torch.randn(1, 14, 7, 64, device=dev, dtype=bf)
    k, v = (torch.randn(KEYS, 2, 64, device=dev, dtype=bf) for _ in range(2))
    assert_each_conversation_alone(q, k, v, window, 0.125, atol=2e-2, longest=longest)


def test_flash_packed_next_turns_in_graphs_write_the_padded_caches():
    """bf16: next turns prefilled packed after what their rows hold (flash attention over each
    row's gathered cache), captured and replayed, write exactly what the eager packed forward
    writes, and what the padded engine's prefill after kept prefixes writes, to bf16's rounding."""
    target = TargetModel(make_tiny_target("qwen2", vocab=11, layers=3).cuda().to(torch.bfloat16))
    engines = [_engine(target, True, prefill="packed").engine, _engine(target, False, prefill="packed").engine,
               _engine(target, False).engine]
    prompts = [[5, 6, 7, 8, 9, 10, 4, 4] * 30, [5, 6, 7, 4], [9, 8, 7, 6, 5] * 9]
    # the rows hold each prompt but its last token; the next turns feed from there
    after = [(0, prompts[0][:-1] + [6, 7, 8, 9] * 5, 239), (2, prompts[2][:-1] + [4, 5], 44)]
    held = [259, 3, 46]
    with torch.inference_mode():
        for e in engines:
            e._prefill(list(enumerate(prompts)), {})
        for _ in range(3):
            for e in engines:
                (e._prefill_after_packed if e.prefill == "packed" else e._prefill_after)(after)
            graphs, eager, padded = engines
            for got, want, near in zip((*graphs.cache_k, *graphs.cache_v), (*eager.cache_k, *eager.cache_v),
                                       (*padded.cache_k, *padded.cache_v)):
                for row, n in enumerate(held):
                    assert torch.equal(got[row, :, :n], want[row, :, :n])
                    assert torch.allclose(got[row, :, :n].float(), near[row, :, :n].float(), atol=5e-2)
    kept = [shape for shape in engines[0].prefill_graphs if shape[0] == "packed-kept"]
    assert kept == [("packed-kept", 1, 128, 512)], kept


def tiny_float32():
    return TargetModel(make_tiny_target("qwen2", vocab=11, layers=1).cuda())


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.9}])
def test_flex_answers_equal_sdpa(tiny, prompts, sampling):
    """float32: the two attentions differ by rounding only, so the tokens are the same."""
    seeds = list(range(len(prompts)))
    flex = _engine(tiny, True, attention="flex", **sampling).generate(prompts, seeds)
    sdpa = _engine(tiny, True, **sampling).generate(prompts, seeds)
    assert [c.ids for c in flex] == [c.ids for c in sdpa]


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_smollm2_float32_answers_equal_hf(smollm2, smollm2_tokenizer, attention):
    target = TargetModel(copy.deepcopy(smollm2.model).cuda())
    texts = [f"What is {i}+{2 * i}? Answer with one number." if i % 2 else f"Write a poem about {i} cats."
             for i in range(16)]
    shaper = ChatShaper(smollm2_tokenizer, [2])
    ids = [shaper.prompt(None, [t], [])[0] for t in texts]
    cfg = BackendConfig(kind="engine", batch_size=8, attention=attention)
    sampling = SamplingConfig(max_new_tokens=24)
    engine = EngineGenerator(target, cfg, sampling, [2], 256).generate(ids, list(range(16)))
    hf = HFGenerator(target, BackendConfig(kind="hf", batch_size=8), sampling, [2], 2).generate(ids, list(range(16)))
    assert [c.ids for c in engine] == [c.ids for c in hf]


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_next_turns_after_kept_rows_equal_fresh_prefills(tiny, prompts, attention):
    """Each conversation's next turn (its prompt, answer and new tokens) queued as its answer
    comes out takes the answer's slot and prefills after what the row holds, behind the
    replayed graphs; the answers equal a fresh engine's for the same prompts (float32)."""
    engine = _engine(tiny, True, attention=attention).engine
    asked = {k: [p[:200]] for k, p in enumerate(prompts[:6])}
    answers = {}
    for k, p in asked.items():
        engine.submit(k, p[0])
    for key, answer in engine.drain():
        answers.setdefault(key, []).append(answer.ids)
        if len(answers[key]) < 3 and answer.finish_reason == "stop":
            asked[key].append(asked[key][-1] + answer.ids + [5, 6, 4 + len(answers[key])])
            engine.submit(key, asked[key][-1])
    assert sum(map(len, answers.values())) > len(asked), "later turns were asked"
    fresh = _engine(tiny, True, batch_size=1, attention=attention).engine
    for k, turns in answers.items():
        for t in range(len(turns)):
            fresh.submit((k, t), asked[k][t])
    assert {key: a.ids for key, a in fresh.drain()} == {(k, t): a for k, turns in answers.items()
                                                        for t, a in enumerate(turns)}
