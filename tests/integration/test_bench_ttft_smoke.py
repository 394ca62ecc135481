"""benchmarks.ttft end to end: real stage processes, real Mooncake, tiny sweep."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_bench_ttft_tiny_sweep_json(tmp_path):
    cmd = [
        sys.executable, "-m", "benchmarks.ttft",
        "--models", "kv-heavy",
        "--lengths", "64", "300",
        "--concurrency", "1",
        "--modes", "colocated", "serial", "pipelined", "fixed-2",
        "--runs", "1",
        "--no-plots",
        "--json",
        "--out", str(tmp_path),
    ]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    for key in ("exposed_fraction_pipelined", "groups", "ttft_ms", "first_token_over_colocated"):
        assert key in out
    # the client's first token (sent before the KV landed) never comes after TTFT (KV landed)
    pip = next(r for r in out["rows"] if r["prompt_len"] == 300 and r["mode"] == "pipelined")
    assert pip["first_token_ms"] <= pip["ttft_ms"]["median"]
    assert set(out["ttft_ms"]) == {"colocated", "serial", "pipelined", "fixed-2"}
    assert all(v > 0 for v in out["ttft_ms"].values())
    assert out["groups"] == 8  # 300 tokens: the adaptive policy streams 8 groups
    assert out["short_prompt_pipelined_over_serial"] is not None  # 64 < min_tokens
    rows = {(r["prompt_len"], r["mode"]): r for r in out["rows"]}
    assert rows[(64, "pipelined")]["groups"] == 1  # under min_tokens: one group, like serial
    assert rows[(300, "fixed-2")]["groups"] == 2
    assert all(r["tokens_match"] for r in out["rows"])  # same first token on every path
    prof = [p for p in out["profiles"] if p["mode"] == "pipelined" and p["prompt_len"] == 300]
    assert len(prof[0]["timeline"]) == 8  # one record per group: compute end, bytes landed
    assert (tmp_path / "table.md").read_text().count("| kv-heavy |") >= 8
