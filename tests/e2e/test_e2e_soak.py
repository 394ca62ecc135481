"""The soak's CI variant: benchmarks.soak with 80 mixed requests (prompts up to 250 tokens, up to
24 new tokens; cancels, injected transfer faults, a prefill stage process killed half way)
against a real server of its own, through the OpenAI front with an API key (the official SDK):
each request equals its reference, gets a clear error in OpenAI's shape, or is cancelled; the
key is required; nothing is left in use or held at the end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_soak_80_requests_end_well_and_leak_nothing():
    env = dict(os.environ, GLOG_minloglevel="2")
    cmd = [sys.executable, "-m", "benchmarks.soak", "--requests", "80", "--json"]
    cmd += ["--max-prompt", "250", "--max-new", "24"]  # shorter requests: CI's time budget
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1500, cwd=ROOT)
    assert proc.stdout.strip(), f"soak printed nothing; stderr tail:\n{proc.stderr[-3000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    failed = {k: v for k, v in result.get("checks", {}).items() if not v}
    assert result["ok"], f"failed checks {failed}; result {result}"
    assert proc.returncode == 0
    assert result["requests"] == 80 and result["front"] == "openai"
    assert result["checks"]["api_key_required"] and result["checks"]["errors_in_openai_shape"]
    assert result["checks"]["no_request_held_at_end"]
    assert result["prefill_reloads"] >= 1, "the killed prefill process was not reloaded"
