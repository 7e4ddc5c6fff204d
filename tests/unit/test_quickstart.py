"""dflash-quickstart's summary lines."""

import json

from dflash_train.quickstart import _held_out


def test_held_out_line_reads_the_last_validation(tmp_path):
    assert _held_out(tmp_path) is None  # no training log yet
    rows = [{"step": 60, "expected_tau": 1.05, "val_expected_tau": 1.061},
            {"step": 65, "expected_tau": 1.07},
            {"step": 300, "expected_tau": 1.131, "val_expected_tau": 1.1449}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _held_out(tmp_path) == ("expected tau at step 300: 1.14 on held-out conversations, 1.13 on training "
                                   "rows (teacher-forced, from the per-position accuracy)")
    (tmp_path / "metrics.jsonl").write_text(json.dumps(rows[1]) + "\n")
    assert _held_out(tmp_path) is None
