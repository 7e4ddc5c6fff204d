"""benchmarks/flex_decode_sweep.py on CPU with tiny shapes: each candidate's row (its time, the
bytes read and held a second, its output against SDPA's over the visible columns), the mask
block changing what the kernel reads, and bad arguments refused."""

import pytest

from benchmarks import flex_decode_sweep

TINY = ["--device", "cpu", "--slots", "4", "--columns", "256", "--mean-pos", "60", "--layers", "2", "--runs", "3"]


def test_rows_per_candidate_match_sdpa(capsys, tmp_path):
    rows = flex_decode_sweep.main([*TINY, "--candidates", "default,block64", "--json", str(tmp_path / "rows.json")])
    assert [r["candidate"] for r in rows] == ["default", "block64"] and [r["block"] for r in rows] == [128, 64]
    for r in rows:
        assert r["max_diff"] < 1e-5 and r["ms"] > 0
        assert r["read_gbs"] >= r["held_gbs"] > 0, "a row reads its blocks whole: at least what it holds"
    # smaller blocks read fewer columns past each row's position in the same time budget per byte
    assert rows[1]["read_gbs"] / rows[1]["held_gbs"] < rows[0]["read_gbs"] / rows[0]["held_gbs"]
    out = capsys.readouterr().out
    assert "4 slots x 2 KV heads x 7 queries" in out and "default" in out and (tmp_path / "rows.json").is_file()


@pytest.mark.parametrize("args, message", [(["--candidates", "fastest"], "--candidates: ['fastest'] not in"),
                                           (["--mean-pos", "200"], "--mean-pos 200: expected 1 to 127")])
def test_bad_arguments_are_refused(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        flex_decode_sweep.main([*TINY, *args])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
