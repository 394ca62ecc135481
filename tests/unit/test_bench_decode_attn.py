"""benchmarks.decode_attn, its short variant: both checkouts timed round by round,
each in its own process, and the bytes-per-second figure follows from the shapes."""

from __future__ import annotations

import json
import os
import statistics

from benchmarks import decode_attn as bench_decode_attn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_this_checkout_against_a_baseline(capsys):
    args = ["--configs", "2x32", "--layers", "2", "--reps", "1", "--rounds", "2", "--json"]
    assert bench_decode_attn.main([*args, "--baseline-root", ROOT]) == 0
    (row,) = json.loads(capsys.readouterr().out)["results"]
    assert row["config"] == "2x32" and set(row["ms_per_layer"]) == {"this", "baseline"}
    assert all(len(ts) == 2 and min(ts) > 0 for ts in row["runs"].values())
    kv_bytes = 2 * 32 * 3 * 64 * 4 * 2
    ms = statistics.median(row["runs"]["this"])  # unrounded, as the script divides by it
    assert row["gb_s"]["this"] == round(kv_bytes / 1e9 / ms * 1e3, 1)
