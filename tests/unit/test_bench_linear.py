"""benchmarks.linear, its short variant: every path that applies at a row count is
timed, and only those (the small-row kernel up to SMALL_ROWS rows, oneDNN for float32)."""

from __future__ import annotations

import json

from backends.runtime.kernels import SMALL_ROWS
from benchmarks import linear as bench_linear


def run(capsys, *args: str) -> dict:
    common = ["--layers", "1", "--big-layers", "1", "--reps", "1", "--json"]
    assert bench_linear.main([*args, *common]) == 0
    return json.loads(capsys.readouterr().out)


def test_float32_paths_by_row_count(capsys):
    out = run(capsys, "--rows", "2", str(SMALL_ROWS + 1))
    small, big = out["results"]
    assert set(small["ms"]) == {"small-row kernel", "oneDNN packed", "F.linear"}
    assert set(big["ms"]) == {"oneDNN packed", "F.linear"}
    assert all(ms > 0 for r in out["results"] for ms in r["ms"].values())


def test_bfloat16_adds_the_widened_path(capsys):
    (row,) = run(capsys, "--rows", "3", "--dtype", "bfloat16")["results"]
    assert set(row["ms"]) == {"small-row kernel", "F.linear", "F.linear widened"}
    assert row["dtype"] == "bfloat16"
