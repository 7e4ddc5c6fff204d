"""The engine's compiled decode step (data_gen/engine.py, `backend.compile`; issue 39: an eager
decode step of a 24-layer target is about 1,400 kernels, each a few microseconds of a 6.5 ms
step on an H200): the same answers as the eager step (float32, flex attention, greedy and
sampled), the KV cache written in place (a scatter into it compiled to two copies of the whole
cache a layer, which on a GPU would cost more than the step), and the settings refused where
they cannot work."""

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from data_gen.config import BackendConfig, SamplingConfig
from data_gen.engine import GenerationEngine
from dflash_train.model.target import TargetModel
from tests.conftest import make_tiny_target

SLOTS, COLUMNS, MAX_NEW = 4, 96, 12
STOP = 33  # greedy, two of the seven answers come to it


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return TargetModel(make_tiny_target("qwen2", layers=2, vocab=50))


def answers(target, compile: bool, region: str = "model", **sampling) -> dict:
    e = GenerationEngine(target, SLOTS, COLUMNS, SamplingConfig(max_new_tokens=MAX_NEW, **sampling), [STOP],
                         cuda_graphs=False, attention="flex", compile=compile, compile_region=region)
    g = torch.Generator().manual_seed(1)
    for i in range(7):  # 7 prompts of 5-59 tokens through 4 slots: rows refill beside others
        e.submit(i, torch.randint(4, 50, (5 + 9 * i,), generator=g).tolist(), seed=i)
    return {key: (c.ids, c.finish_reason) for key, c in e.drain()}


@pytest.mark.parametrize("region", ["model", "layer"])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "top_p": 0.8}])
def test_compiled_steps_give_the_eager_answers(target, sampling, region):
    eager, compiled = answers(target, False, **sampling), answers(target, True, region, **sampling)
    assert compiled == eager and len(eager) == 7
    assert {reason for _, reason in eager.values()} == {"stop", "length"}, "rows ended both ways"


def test_the_compiled_step_writes_the_cache_in_place(target):
    """No buffer of the cache's shape in the generated code: the step writes the new keys and
    values into the cache rows themselves."""
    e = GenerationEngine(target, SLOTS, COLUMNS, SamplingConfig(max_new_tokens=MAX_NEW), [3], cuda_graphs=False,
                         attention="flex", compile=True)
    e.submit(0, [5, 6, 7, 8])
    with torch.inference_mode():
        e._admit(None)
        before = [c.clone() for c in e.cache_k]
        _, code = run_and_get_code(e._step, COLUMNS)
    cache_shape = tuple(e.cache_k[0].shape)
    assert cache_shape == (SLOTS, 2, COLUMNS, 16)
    buffers = re.findall(r"empty_strided\w*\(\(([\d, ]+)\)", "\n".join(code))
    assert buffers and all(tuple(int(n) for n in b.split(",") if n.strip()) != cache_shape for b in buffers), buffers
    assert all(not torch.equal(b[0, :, 3], a[0, :, 3]) for a, b in zip(before, e.cache_k)), "position 3 written"


def test_compile_needs_the_engine_and_flex():
    with pytest.raises(ValueError, match=r"backend.compile=true needs backend.attention flex"):
        BackendConfig(kind="engine", attention="sdpa", compile=True).check()
    with pytest.raises(ValueError, match=r"backend.compile=true is the engine's; backend.kind is 'hf'"):
        BackendConfig(kind="hf", compile=True).check()
    cfg = BackendConfig(kind="engine", device="cpu", compile=True)
    with pytest.raises(ValueError, match=r"backend.compile=true needs backend.attention flex"):
        cfg.resolve()  # auto is sdpa on CPU


def test_the_engine_refuses_compile_with_sdpa(target):
    with pytest.raises(ValueError, match=r"compile=True needs the flex decode attention \(attention='sdpa'\)"):
        GenerationEngine(target, SLOTS, COLUMNS, SamplingConfig(max_new_tokens=2), [3], attention="sdpa", compile=True)


def test_compile_is_on_by_default_only_on_a_gpu_with_flex(target):
    """auto (None): compiled where the engine decodes on CUDA with flex; on CPU the step is eager."""
    for attention in ("sdpa", "flex"):
        e = GenerationEngine(target, SLOTS, COLUMNS, SamplingConfig(max_new_tokens=2), [3], attention=attention)
        assert e._step == e._decode
    assert BackendConfig().compile is None


def test_a_step_that_does_not_compile_decodes_eagerly(target, monkeypatch):
    """On CUDA the graphs are captured from the compiled step; when it fails (a target whose
    forward dynamo cannot take whole), a warning says so and the eager step is captured. The
    capture is simulated here (a CPU has no graphs): it runs what it would capture."""
    e = GenerationEngine(target, SLOTS, COLUMNS, SamplingConfig(max_new_tokens=2), [3], cuda_graphs=False,
                         attention="flex", compile=True)
    ran = []

    def broken(width):
        raise RuntimeError("Unsupported: a graph break\nmore detail")

    e._step, e.graphs = broken, {}
    monkeypatch.setattr(e, "_decode", lambda width: ran.append(width))
    monkeypatch.setattr(e, "_capture", lambda run, warmups: (run(), f"graph of {warmups}")[1])
    with pytest.warns(UserWarning, match=r"did not compile \(RuntimeError: Unsupported: a graph break\); it runs "
                                         r"eagerly"):
        e._capture_all()
    assert e.graphs == {COLUMNS: "graph of 2"} and ran == [COLUMNS] and e._step == e._decode


def test_engines_of_one_cache_shape_share_the_compiled_forward(target):
    """The step compiles in two parts, the forward and the token choice: a second engine whose
    cache rows are as long compiles only its own token choice, whatever it samples (the magpie
    writer beside the answers: a machine's first run compiled each whole step in 33-44 s on an
    H200), and gives the answers of its eager step."""
    from torch._dynamo.utils import counters

    def compiled() -> tuple[int, int]:  # graphs, and the operators dynamo put in them
        return counters["stats"]["unique_graphs"], counters["stats"]["calls_captured"]

    def since(start: tuple[int, int]) -> tuple[int, int]:
        return tuple(a - b for a, b in zip(compiled(), start))

    torch._dynamo.reset()  # what earlier tests compiled is compiled again here
    start = compiled()
    greedy = answers(target, True)
    graphs, step_ops = since(start)
    assert graphs == 2, "the first engine: its forward and its token choice"
    start = compiled()
    sampled = answers(target, True, temperature=0.9, top_p=0.8)
    graphs, choice_ops = since(start)
    assert graphs == 1 and choice_ops < step_ops / 2, "the sampled engine compiled its token choice alone"
    assert sampled == answers(target, False, temperature=0.9, top_p=0.8) and greedy == answers(target, False)
    start = compiled()
    e = GenerationEngine(target, SLOTS, COLUMNS + 16, SamplingConfig(max_new_tokens=MAX_NEW), [STOP],
                         cuda_graphs=False, attention="flex", compile=True)
    e.submit(0, [5, 6, 7])
    # longer rows: a forward of their own (the greedy choice is the first engine's)
    assert len(list(e.drain())) == 1 and since(start)[0] == 1


def test_a_compiled_layer_serves_the_whole_stack(target):
    """backend.compile_region=layer: dynamo traces one decoder layer's decode forward, and every
    layer runs that graph with its own weights and cache (a target of 3 layers: one graph for
    them, a third of the operators the whole forward's graph holds); the prefills, of varying
    shapes, stay eager (no graph per prompt length); a second engine of the same rows compiles
    only its token choice; the answers are the eager step's."""
    from torch._dynamo.utils import counters

    three = TargetModel(make_tiny_target("qwen2", layers=3, vocab=50))

    def compiled() -> tuple[int, int]:
        return counters["stats"]["unique_graphs"], counters["stats"]["calls_captured"]

    ops = {}
    for region in ("model", "layer"):
        torch._dynamo.reset()
        start = compiled()
        greedy = answers(three, True, region)
        graphs, ops[region] = (a - b for a, b in zip(compiled(), start))
        assert graphs == 2, f"{region}: the forward (or its one layer) and the token choice"
        assert greedy == answers(three, False)
    assert ops["layer"] < ops["model"] / 2, ops
    start = compiled()
    sampled = answers(three, True, "layer", temperature=0.9, top_p=0.8)
    assert compiled()[0] - start[0] == 1, "the second engine compiled its token choice alone"
    assert sampled == answers(three, False, temperature=0.9, top_p=0.8)


def test_a_compiled_layer_step_writes_each_layers_own_cache(target):
    """Given its layer's cache by the step, a compiled layer writes that cache alone: after one
    step every layer's cache holds the new position, and the layers' entries differ."""
    e = GenerationEngine(target, SLOTS, COLUMNS, SamplingConfig(max_new_tokens=MAX_NEW), [3], cuda_graphs=False,
                         attention="flex", compile=True, compile_region="layer")
    e.submit(0, [5, 6, 7, 8])
    with torch.inference_mode():
        e._admit(None)
        before = [c.clone() for c in e.cache_k]
        e._step(COLUMNS)
    assert all(not torch.equal(b[0, :, 3], a[0, :, 3]) for a, b in zip(before, e.cache_k)), "position 3 written"
    assert not torch.equal(e.cache_k[0][0, :, 3], e.cache_k[1][0, :, 3]), "each layer its own entries"


def test_compile_region_is_checked():
    with pytest.raises(ValueError, match=r"backend.compile_region='layers': expected one of \['layer', 'model'\]"):
        BackendConfig(compile_region="layers").check()
    with pytest.raises(ValueError, match=r"compile_region='stack': expected one of \['layer', 'model'\]"):
        GenerationEngine(TargetModel(make_tiny_target("qwen2", layers=1, vocab=50)), SLOTS, COLUMNS,
                         SamplingConfig(max_new_tokens=2), [3], compile_region="stack")


def test_layers_that_do_not_compile_decode_eagerly(target, monkeypatch):
    """backend.compile_region=layer where torch.compile fails (a target dynamo cannot take): the
    warning, then the eager layers put back, so the step runs and gives the eager answers. The
    capture is simulated as above."""
    def broken_compile(fn, **options):
        def fails(*args, **kwargs):
            raise RuntimeError("Unsupported: a graph break")
        return fails

    monkeypatch.setattr(torch, "compile", broken_compile)
    e = GenerationEngine(target, SLOTS, COLUMNS, SamplingConfig(max_new_tokens=MAX_NEW), [STOP], cuda_graphs=False,
                         attention="flex", compile=True, compile_region="layer")
    monkeypatch.setattr(e, "_capture", lambda run, warmups: (run(), "graph")[1])
    e.graphs = {}
    with pytest.warns(UserWarning, match=r"did not compile \(RuntimeError: Unsupported: a graph break\)"), \
            torch.inference_mode():
        e._capture_all()
    assert e._step == e._decode
    e.graphs = None
    g = torch.Generator().manual_seed(1)
    for i in range(7):
        e.submit(i, torch.randint(4, 50, (5 + 9 * i,), generator=g).tolist(), seed=i)
    assert {key: (c.ids, c.finish_reason) for key, c in e.drain()} == answers(target, False)
