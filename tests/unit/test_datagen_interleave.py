"""data_gen.pipeline.interleave: the order prompts start in mixes the sources in proportion, so
a budget cuts each source alike."""

from data_gen.pipeline import interleave
from data_gen.sources import SourcePrompt


def prompts(source: str, n: int) -> list[SourcePrompt]:
    return [SourcePrompt(f"{source}{i}", source, None, (f"{source} question {i}",)) for i in range(n)]


def ids(ordered: list[SourcePrompt]) -> list[str]:
    return [p.prompt_id for p in ordered]


def test_two_sources_of_one_size_alternate_the_first_source_first():
    assert ids(interleave(prompts("a", 3) + prompts("b", 3))) == ["a0", "b0", "a1", "b1", "a2", "b2"]


def test_sources_mix_in_proportion_each_in_its_own_order():
    """6 of a, 2 of b, 1 of c: b's share is a third of a's all along; at any cut each source has
    handed out about the same share of its prompts."""
    got = ids(interleave(prompts("a", 6) + prompts("b", 2) + prompts("c", 1)))
    assert got == ["a0", "b0", "c0", "a1", "a2", "a3", "b1", "a4", "a5"]
    for source in "abc":
        mine = [i for i in got if i[0] == source]
        assert mine == sorted(mine, key=lambda i: int(i[1:]))
    first_half = got[:5]
    assert sorted(i[0] for i in first_half) == ["a", "a", "a", "b", "c"]


def test_one_source_and_none_keep_their_order():
    assert ids(interleave(prompts("a", 4))) == ["a0", "a1", "a2", "a3"]
    assert interleave([]) == []
