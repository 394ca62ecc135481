"""The control-plane fuzzer's short run (benchmarks.fuzz_control runs 100,000 messages)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_fuzzer_short_run_passes_every_check():
    cmd = [sys.executable, "-m", "benchmarks.fuzz_control"]
    cmd += ["--messages", "3000", "--legit-every", "500", "--json", "--no-progress", "--seed", "7"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=ROOT)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 0 and result["ok"], result
    assert result["messages"] == 3000 and result["legit_rooms"] >= 6
    # every frame that could never be valid was dropped and counted by its target: exactly those
    # at prefill and decode (nothing let through, no valid frame counted as invalid)
    assert result["checks"]["invalid_frames_dropped"], result
    # the frames really were hostile: over 40 % of each target's could never be valid, dropped
    # for several reasons, and oversize frames made prefill and the cancel listener disconnect
    for target, sent in result["per_target"].items():
        assert result["must_drop"][target] > 0.4 * sent, result
    assert len(result["prefill_dropped"]) >= 4 and len(result["decode_dropped"]) >= 3, result
    assert result["oversize"]["prefill"] > 0 and result["oversize"]["cancel"] > 0, result
