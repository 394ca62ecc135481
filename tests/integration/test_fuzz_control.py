"""The control-plane fuzzer's short run (scripts/fuzz_control.py runs 100,000 messages)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_fuzzer_short_run_passes_every_check():
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "fuzz_control.py")]
    cmd += ["--messages", "3000", "--legit-every", "500", "--json", "--no-progress", "--seed", "7"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 0 and result["ok"], result
    assert result["messages"] == 3000 and result["legit_rooms"] >= 6
    # the frames really were hostile: every target dropped many of them, for several reasons
    assert len(result["prefill_dropped"]) >= 4 and sum(result["prefill_dropped"].values()) > 200
    assert sum(result["decode_dropped"].values()) > 300
