"""benchmarks.recurrent_scan, its short variant: the runtime's chunked recurrent forms and
transformers' fallbacks on the same inputs give the same outputs and final states."""

from __future__ import annotations

import json

from benchmarks import recurrent_scan


def test_every_form_is_timed_and_agrees_with_the_runtimes(capsys):
    argv = ["--lengths", "80", "--reps", "1", "--recurrent-max", "80", "--json"]
    assert recurrent_scan.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    methods = {(r["mixer"], r["method"]) for r in rows}
    assert methods == {
        ("gated_deltanet", "runtime chunked"),
        ("gated_deltanet", "transformers chunked"),
        ("gated_deltanet", "transformers token loop"),
        ("mamba2", "runtime chunked"),
        ("mamba2", "transformers chunked"),
    }
    for r in rows:
        assert r["ms"] > 0 and r["tokens"] == 80
        if r["method"] != "runtime chunked":  # 80 tokens: a chunk and a padded one
            assert r["max_diff_out"] < 1e-3 and r["max_diff_state"] < 1e-3, r
