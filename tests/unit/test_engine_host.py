"""The generation engine's host work per forward (data_gen/engine.py, issue 39: on a GPU the
device waits while the host issues a prefill's operators; benchmarks/engine_host_cost.py):
transformers builds no attention mask for the engine's attention, a prefill after kept
prefixes builds its positions and write indices once a forward rather than once a layer, and
the chunk length between reads of the slots (`sync_steps`) is checked."""

import contextlib
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from data_gen.config import SamplingConfig
from data_gen.engine import GenerationEngine
from dflash_train.model.target import TargetModel
from tests.conftest import make_tiny_target


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[str(func)] += 1
        return func(*args, **(kwargs or {}))


def engine(layers: int = 2, **kwargs) -> GenerationEngine:
    target = TargetModel(make_tiny_target("qwen2", layers=layers))
    return GenerationEngine(target, 4, 64, SamplingConfig(max_new_tokens=4), [1], cuda_graphs=False, **kwargs)


def test_transformers_builds_no_mask_for_the_engine(monkeypatch):
    """The engine's attention ignores the mask argument; transformers (4.57 to 5.24 at least)
    skips building one for an attention name its mask registry does not know, so the engine
    registers none. Were a version to build one, it would be host and device work per forward."""
    from transformers.models.qwen2 import modeling_qwen2

    built = []
    create = modeling_qwen2.create_causal_mask
    monkeypatch.setattr(modeling_qwen2, "create_causal_mask", lambda *a, **k: built.append(create(*a, **k)))
    e = engine()
    with torch.inference_mode():
        e._prefill([(0, [5, 6, 7, 8])], {})
        e._prefill_after([(1, [5, 6, 7, 8, 9, 10], 4)])
    assert built == [None, None]


@pytest.mark.parametrize("op", ["aten.arange.default", "aten.where.ScalarOther", "aten.lt.Tensor"])
def test_kept_prefill_builds_its_indices_once_a_forward(op):
    """The same operators for a target of 2 and of 6 layers: what every layer shares (the fed
    tokens' positions, their cache columns, the mask) is built once."""
    counts = []
    for layers in (2, 6):
        e = engine(layers)
        with torch.inference_mode(), Ops() as ops:
            e._prefill_after([(0, [5, 6, 7, 8, 9, 10], 4), (2, [3, 4, 5, 6, 7], 2)])
        counts.append(ops.count[op])
    assert counts[0] == counts[1] and counts[0] >= 1, counts


def test_kept_prefill_writes_what_a_whole_prefill_writes():
    """A row that prefills 4 tokens then 3 more after them holds the keys/values of one that
    prefills the 7 at once (float32 on CPU), in every layer, up to the tokens fed."""
    tokens = [5, 6, 7, 8, 9, 10, 11]
    e = engine()
    with torch.inference_mode():  # _prefill feeds a prompt but its last token
        for slot, prompt in enumerate([tokens + [2], tokens[:4] + [2], [3, 4]]):  # one a forward: no padding
            e._prefill([(slot, prompt)], {})
        e._prefill_after([(1, tokens, 4), (2, [3, 4, 5], 1)])  # row 2 feeds 2 tokens: padding in the group
    for cache in (*e.cache_k, *e.cache_v):
        torch.testing.assert_close(cache[1, :, :7], cache[0, :, :7], rtol=1e-5, atol=1e-6)
        assert cache[1, :, 7:].abs().sum() == 0, "nothing written past the row's tokens"
        assert cache[2, :, 3:-1].abs().sum() == 0 < cache[2, :, -1].abs().sum(), "padding: the last column"


def test_bucketed_prefills_write_what_exact_ones_write():
    """At the shapes of CUDA graphs (rows and widths rounded up to powers of two, a group
    padded with copies of its first row, a kept span of BUCKET_SPAN columns), eager on CPU: every
    row holds the keys/values an exact-shape forward writes, up to its tokens (float32). Three
    fresh rows make a group of 4 (one copy); two kept rows, a group of 2 of width 16."""
    exact, bucketed = engine(), engine(buckets=True)
    assert bucketed.cache_k[0].shape[2] == 64 and exact.shapes.buckets is False and bucketed.shapes.buckets is True
    prompts = [[5, 6, 7, 8, 9, 10, 11, 2], [5, 6, 7, 2], [3, 4, 5, 6, 2]]
    with torch.inference_mode():
        for e in (exact, bucketed):
            e._prefill(list(enumerate(prompts)), {})
            e._prefill_after([(1, [5, 6, 7, 8, 9, 10, 11], 3), (2, [3, 4, 5, 6, 7], 4)])
    for got, want in zip((*bucketed.cache_k, *bucketed.cache_v), (*exact.cache_k, *exact.cache_v)):
        for row, held in enumerate([7, 7, 5]):
            torch.testing.assert_close(got[row, :, :held], want[row, :, :held], rtol=1e-5, atol=1e-6)
    assert bucketed.prefill_counts == exact.prefill_counts == Counter(), "no graphs off CUDA"


class Replayable:
    """A stand-in for a captured CUDA graph on CPU: its replay runs what was captured, so it
    reads the input buffer as the graph would."""

    def __init__(self, run):
        self.run = run

    def replay(self):
        self.run()


class Spans:
    def __init__(self):
        self.parts = []

    @contextlib.contextmanager
    def span(self, part, tokens=0, **info):
        yield
        self.parts.append((part, tokens))


def test_prefill_graph_path_runs_eager_then_captures_then_replays(monkeypatch):
    """The prefill's graph path (CUDA in use, simulated: `_capture` runs its warm-up and returns a
    replayable stand-in): a shape's first forward eager, its second captured, its third replayed
    from the captured buffer refilled with the new rows; the first two timed as prefill-first.
    Every round's rows hold what the exact-shape engine writes; the third round feeds other tokens
    through the same shapes."""
    graphs, exact = engine(buckets=True), engine()
    graphs.graphs = {}  # as on CUDA
    captured = []
    monkeypatch.setattr(graphs, "_capture", lambda run, warmups, mid_run=False: (
        captured.append((warmups, mid_run)), run(), Replayable(run))[2])
    graphs.timer = Spans()
    rounds = [([[5, 6, 7, 8, 9, 10, 11, 2], [5, 6, 7, 2], [3, 4, 5, 6, 2]],
               [(1, [5, 6, 7, 8, 9, 10, 11], 3), (2, [3, 4, 5, 6, 7], 4)])] * 2
    rounds.append(([[9, 9, 8, 8, 7, 7, 6, 2], [1, 2, 3, 2], [4, 4, 4, 4, 2]],
                   [(1, [1, 2, 3, 5, 5, 5, 5], 3), (2, [4, 4, 4, 4, 9], 4)]))
    with torch.inference_mode():
        for prompts, after in rounds:
            for e in (graphs, exact):
                e._prefill(list(enumerate(prompts)), {})
                e._prefill_after(after)
            for got, want in zip((*graphs.cache_k, *graphs.cache_v), (*exact.cache_k, *exact.cache_v)):
                for row, held in enumerate([7, 7, 5]):
                    torch.testing.assert_close(got[row, :, :held], want[row, :, :held], rtol=1e-5, atol=1e-6)
    assert graphs.prefill_counts == Counter(eager=2, captured=2, replayed=2)
    assert captured == [(1, True)] * 2, "one warm-up each, captured mid-run (no wait for the device)"
    assert sorted(graphs.prefill_graphs) == [("fresh", 4, 16), ("kept", 2, 16, 64)]
    assert [part for part, _ in graphs.timer.parts] == ["prefill-first"] * 4 + ["prefill", "prefill-kept"]
    assert {tokens for part, tokens in graphs.timer.parts if part == "prefill-kept"} == {5}  # 4 + 1 fed


@pytest.mark.parametrize("sync_steps, chunk", [(None, 1), (1, 1), (3, 3)])
def test_sync_steps_sets_the_chunk(sync_steps, chunk):
    """None: the engine's default, one step a chunk off CUDA (STEPS_PER_SYNC on a GPU)."""
    assert engine(sync_steps=sync_steps).sync_steps == chunk


@pytest.mark.parametrize("sync_steps", [0, -1])
def test_sync_steps_below_one_is_refused(sync_steps):
    with pytest.raises(ValueError, match=rf"^sync_steps={sync_steps}: expected an integer >= 1, or None"):
        engine(sync_steps=sync_steps)


def test_host_cost_benchmark_prints_its_table(capsys):
    """benchmarks/engine_host_cost.py end to end with tiny settings: a row per piece, each with
    a time and the operators it dispatched, then cProfile's rows."""
    from benchmarks import engine_host_cost

    engine_host_cost.main(["--repeats", "2", "--slots", "8", "--rows", "4", "--profile-top", "3"])
    out = capsys.readouterr().out
    rows = {line[:22].strip(): line[22:].split() for line in out.splitlines()[2:7]}
    assert list(rows) == ["fresh prefill", "kept prefill", "admit round", "harvest", "decode step (eager)"], out
    assert all(float(median) >= float(low) > 0 and int(ops) > 0 for median, low, ops in rows.values()), rows
    # a kept-prefix forward and a fresh one, both in the admission round
    assert int(rows["admit round"][2]) > int(rows["kept prefill"][2]) + int(rows["fresh prefill"][2]) / 2
    assert "cProfile of 2 fresh prefill forwards (4 rows), by own time:" in out and "tottime" in out
