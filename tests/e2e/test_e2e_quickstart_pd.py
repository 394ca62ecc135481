"""The README's disaggregated quick start, run exactly as written (two `--role prefill` servers
and one `--role decode` server on 127.0.0.1, the client, the routing metrics, stop).

It runs in a private network namespace (`unshare -n`, loopback up) so the README's fixed ports
never collide with other servers on this host; without one (not root) it runs on the host's
loopback as is."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
from triton_harness import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def readme_block() -> list[str]:
    text = open(os.path.join(ROOT, "README.md")).read()
    block = text.split("<!-- quickstart-disaggregated -->", 1)[1].split("<!-- end", 1)[0]
    body = block.split("```bash", 1)[1].split("```", 1)[0]
    return [ln for ln in body.strip().splitlines() if ln.strip()]


def test_readme_disaggregated_quickstart_works_as_written(tmp_path):
    lines = readme_block()
    assert sum("--role prefill" in ln for ln in lines) == 2
    assert sum("--role decode" in ln for ln in lines) == 1
    script = "set -e\n" + "\n".join(lines) + "\n"
    env = {**os.environ, "PD_RUN_DIR": str(tmp_path / "run"), "OMP_NUM_THREADS": "1"}
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True)
    if probe.returncode == 0:
        cmd = ["unshare", "-n", "bash", "-c", 'ip link set lo up && bash -c "$0"', script]
    else:
        cmd = ["bash", "-c", script]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "The capital of France is Paris." in out.stdout
    answer = [json.loads(ln) for ln in out.stdout.splitlines() if "text_completion" in ln]
    assert len(answer) == 1 and answer[0]["usage"]["completion_tokens"] == 4  # the OpenAI API
    assert answer[0]["choices"][0]["finish_reason"] == "length"
    routed = re.findall(r'^pd_router_requests_total\{.*server="([^"]+)".*\} (\S+)$',
                        out.stdout, re.M)  # fmt: skip
    assert sorted(s for s, _ in routed) == ["127.0.0.1:8101", "127.0.0.1:8201"]
    assert sum(float(v) for _, v in routed) == 2.0  # client.py's and the OpenAI request
    assert out.stdout.count("stopped tritonserver") == 3
