"""benchmarks/serving_step.py on the tiny Qwen3, CPU: the rows, and the ``--profile`` tables.

CPU times mean nothing for the GPU; what is checked is the tables' structure, that the groups
add up to the total measured apart from them (the steps' own profiler ranges), and the GEMM
shapes and bytes the tiny geometry fixes: 4 layers, hidden 128, 4 query heads and 2 K/V heads
of 32, MLP 256, vocabulary 1024, float32.
"""

import re

import pytest

from benchmarks.serving_step import main
from benchmarks.step_profile import GROUPS

pytestmark = pytest.mark.usefixtures("one_thread")

ARGS = ["--tiny", "--device", "cpu", "--prompt", "24", "--slots", "96", "--replays", "1", "--batch", "1",
        "--verify", "3"]
ROW = re.compile(r"^(\S.{0,19}?)\s+(\d+)\s+(-?\d+\.\d+)\s+(-?\d+\.\d+)%\s+(\d+\.\d+)\s+(\d+\.\d+)\s")


def group_rows(text: str) -> dict[str, dict]:
    """The group table's rows: name -> ops, ms, MB moved and the GEMM shapes, up to `total`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("group "))
    rows = {}
    for line in lines[start + 1:]:
        if line.startswith("total"):
            rows["total"] = {"ms": float(line.split()[2])}
            return rows
        m = ROW.match(line)
        assert m, line
        rows[m.group(1)] = {"ops": int(m.group(2)), "ms": float(m.group(3)), "mb": float(m.group(5)),
                            "detail": line.split("  ")[-1].strip()}
    raise AssertionError("no total row")


def measured_total(text: str) -> float:
    return float(re.search(r"all groups: (\d+\.\d+) ms", text).group(1))


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile")
    rows = main([*ARGS, "--gqa", "repeat", "packed", "--profile", str(out)])
    return rows, {p.name: p.read_text() for p in out.iterdir()}


def test_rows_for_each_gqa_path(profiled):
    rows, _ = profiled
    assert [(r["gqa"], r["batch"], r["k"]) for r in rows] == [("repeat", 1, 3), ("packed", 1, 3)]
    for r in rows:
        assert r["rest_ms"] == pytest.approx(r["step_ms"] - r["draft_ms"] - r["verify_ms"])


def test_profile_files_and_groups_add_up(profiled):
    _, files = profiled
    assert sorted(files) == ["profile-b1-k3-packed.txt", "profile-b1-k3.txt", "profile-b1-plain-packed.txt",
                             "profile-b1-plain.txt"]
    for name, text in files.items():
        assert "CPU: the times are host compute and mean nothing for a GPU" in text
        rows = group_rows(text)
        groups = [g for g in rows if g != "total"]
        assert groups == [g for g in GROUPS if g in groups], name  # known groups, in the table's order
        assert {"qkv GEMM", "o GEMM", "gate/up GEMM", "down GEMM", "lm_head GEMM", "attention (sdpa)",
                "cache writes", "norms", "elementwise", "runtime"} <= set(groups), name
        assert "other" not in groups, (name, rows.get("other"))
        total = measured_total(text)
        assert sum(rows[g]["ms"] for g in groups) == pytest.approx(total, rel=0.01), name
        assert rows["total"]["ms"] == pytest.approx(total, rel=0.01), name
        assert rows["attention (sdpa)"]["ops"] == 4 and rows["cache writes"]["ops"] == 8  # a layer: K and V


def test_gemm_shapes_and_bytes(profiled):
    _, files = profiled
    for part, m in (("plain", 1), ("k3", 4)):  # rows of the GEMMs: one token, or the anchor and 3 drafts
        rows = group_rows(files[f"profile-b1-{part}.txt"])
        assert rows["qkv GEMM"]["detail"] == f"{m}x64x128 x8, {m}x128x128 x4"
        assert rows["o GEMM"]["detail"] == f"{m}x128x128 x4"
        assert rows["gate/up GEMM"]["detail"] == f"{m}x256x128 x8"
        assert rows["down GEMM"]["detail"] == f"{m}x128x256 x4"
        assert rows["lm_head GEMM"]["detail"] == f"{m}x1024x128 x1"
        # weights, inputs and outputs in float32: lm_head (1024*128 + m*128 + m*1024) * 4 bytes
        assert rows["lm_head GEMM"]["mb"] == pytest.approx(4 * (1024 * 128 + m * 1152) / 1e6, abs=0.006)


def test_repeat_copies_kv_and_packed_does_not(profiled):
    _, files = profiled
    repeat = group_rows(files["profile-b1-k3.txt"])
    # repeat_kv: K and V of 2 heads x 96 slots x 32 read, written for 4 heads, in 4 layers
    assert repeat["K/V repeat for GQA"]["ops"] == 8
    assert repeat["K/V repeat for GQA"]["mb"] == pytest.approx(8 * 4 * (2 + 4) * 96 * 32 / 1e6, abs=0.006)
    for name in ("profile-b1-k3-packed.txt", "profile-b1-plain-packed.txt"):
        assert "K/V repeat for GQA" not in group_rows(files[name])
    comparison = files["profile-b1-k3.txt"].split("plain step vs verify k=3")[1]
    assert re.search(r"^K/V repeat for GQA\s+\d+\.\d+\s+\d+\.\d+\s+[+-]\d+\.\d+\s+\d+\s+8$", comparison, re.MULTILINE)
    assert re.search(r"^timed step\s+\d+\.\d+\s+\d+\.\d+", comparison, re.MULTILINE)


def test_weights_a_step_reads():
    # The tiny geometry's layer: q 128x128, k and v 128x64, o 128x128, MLP 3 x 128x256, norms
    # 128 + 128 + 32 + 32: 147,776. Target: 4 layers, the final norm, the LM head 1024x128 (its
    # embedding aside): 722,304. Draft: 5 layers, fc (5 x 128) x 128, two norms of 128, and the
    # target's LM head: 952,128.
    import torch

    from benchmarks.serving_step import bound_line, build, parse_args, weight_reads

    target, drafter = build(parse_args(ARGS), torch.device("cpu"))
    assert weight_reads(target, drafter) == (4 * 147_776 + 128 + 131_072, 5 * 147_776 + 81_920 + 256 + 131_072)
    assert bound_line(target, drafter).endswith("at least the verify + 1.318 plain steps")
