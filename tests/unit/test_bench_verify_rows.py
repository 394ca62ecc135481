"""benchmarks.verify_rows, its short variant on a tiny checkpoint: both layouts of W chains are
timed, with the rows each feeds (W (k + 1) separate, 1 + W k rooted at the first chain)."""

from __future__ import annotations

import json

import runtime_models as rm

from benchmarks import verify_rows


def test_both_layouts_and_their_rows(capsys):
    args = ["--model", rm.checkpoint("llama"), "--branches", "1", "3", "--k", "2",
            "--context", "9", "--reps", "2", "--json"]  # fmt: skip
    assert verify_rows.main(args) == 0
    one, three = json.loads(capsys.readouterr().out)["results"]
    assert one["rows"] == {"separate": 3, "rooted": 3} and one["ms_per_row_saved"] is None
    assert three["rows"] == {"separate": 9, "rooted": 7}
    for r in (one, three):
        for layout in ("separate", "rooted"):
            s = r[layout]
            assert 0 < s["min_ms"] <= s["median_ms"] <= s["p99_ms"] <= s["max_ms"]
