"""benchmarks.hybrid's exposed-transfer part end to end: real stage processes, real Mooncake,
the tiny hybrids: every state entry crosses, with its layer group or, held back, after the last."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_bench_hybrid_quick_exposed_json(tmp_path):
    from backends.runtime.config import ModelConfig
    from backends.runtime.state_pool import StateSpec

    cmd = [sys.executable, "-m", "benchmarks.hybrid", "--quick", "--parts", "exposed", "--json",
           "--model-dir", str(tmp_path)]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)["exposed"]
    assert {(c["model"], c["prompt_len"]) for c in out["compare"]} == {
        ("qwen3-next-tiny", 300),
        ("nemotron-h-tiny", 300),
    }
    for r in out["rows"]:
        if r["mode"] == "colocated":
            continue
        spec = StateSpec.of(ModelConfig.from_pretrained(str(tmp_path / r["model"])))
        assert r["bytes"]["target.state"] == spec.bytes_per_sequence  # every layer's slot
        # one attention layer, float32, whole pages of 16: 19 of them
        assert r["bytes"]["target"] == 19 * 16 * 2 * 2 * 32 * 4
        assert r["state_as_planned"] and r["first_token_matches_colocated"]
        # 300 tokens: 4 groups of one layer; a state group per group holding a recurrent layer
        want = {"with-group": len(spec.layers), "at-end": 1}[r["mode"]]
        assert r["state_groups"] == want, r
    for c in out["compare"]:
        assert c["exposed_with_group_ms"] >= 0 and c["ttft_at_end_ms"] > 0
