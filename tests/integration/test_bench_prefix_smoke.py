"""benchmarks.prefix --quick: the multi-turn chat workload against the stage cores in one
process (two PrefillWorkers behind a PrefillRouter, a DecodeWorker, real Mooncake; no Triton)
in every mode. The real-server run (scripts/serve.sh, ~13 minutes) is the documented command in
docs/benchmarks.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
HEADLINE = (
    "ttft_p50_cached_over_uncached",
    "reuse_fraction",
    "bytes_over_uncached_share",
    "prefill_hit_rate_cache_aware_over_least_queue",
)


def test_bench_prefix_quick_json(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.prefix", "--quick", "--json"]
    cmd += ["--out", str(tmp_path / "prefix")]
    env = dict(os.environ, GLOG_minloglevel="2")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=ROOT, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    assert all(out[key] is not None for key in HEADLINE)
    assert set(out["targets"]) == set(HEADLINE) - {"reuse_fraction"}
    assert all(t["met"] in (True, False) for t in out["targets"].values())
    modes = out["modes"]
    assert set(modes) == {"pd-cache", "pd-queue", "pd-off", "single-cache", "single-off"}
    assert all(m["errors"] == 0 and m["requests"] >= 4 for m in modes.values())
    # later turns resend the system prompt and the history: most of each prompt was seen
    assert 0.5 < out["reuse_fraction"] < 1
    for mode in ("pd-cache", "pd-queue", "single-cache"):
        m = modes[mode]
        assert m["prefill_hit_rate"] > 0.3 and m["decode_hit_rate"] > 0.3, mode
        assert m["usage_cached_tokens"] > 0  # usage reports what prefill did not compute
        assert m["prefill_tokens_computed"] < modes["pd-off"]["prefill_tokens_computed"]
        # greedy: a prefix hit never changes an answer, so the chats stay identical
        equal, compared = out["answers_equal_cache_off"][mode]
        assert equal == compared == m["requests"], mode
    for mode in ("pd-off", "single-off"):
        m = modes[mode]
        assert m["prefill_hit_rate"] == 0 and m["usage_cached_tokens"] == 0
        assert m["prefill_tokens_computed"] == m["prompt_tokens"]
    # decode held part of each prompt: fewer KV bytes moved, about its uncached share
    assert 0.8 < out["bytes_over_uncached_share"] < 1.3
    assert modes["pd-cache"]["router_cached_tokens"] > 0  # the router expected hits
    assert (tmp_path / "prefix.json").is_file() and (tmp_path / "prefix.png").is_file()
