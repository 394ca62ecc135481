"""scripts/gpu_check.sh where CI can run it (no GPU): it parses, documents itself, takes another
Python through PD_PYTHON, and refuses a host without CUDA with a clear message."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "gpu_check.sh")


def _run(*args: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **env))  # fmt: skip


def test_help_and_bad_arguments():
    assert subprocess.run(["bash", "-n", SCRIPT]).returncode == 0
    out = _run("--help")
    assert out.returncode == 0 and "PD_PYTHON" in out.stdout and "SKIPPED" in out.stdout
    bad = _run("--no-such-flag")
    assert bad.returncode == 2 and "unknown argument --no-such-flag" in bad.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA host runs the check itself")
def test_refuses_a_host_without_cuda(tmp_path):
    out = _run("--out", str(tmp_path / "gpu"), PD_PYTHON=sys.executable)
    assert out.returncode == 1 and "needs torch with CUDA and a GPU" in out.stderr
    missing = _run("--out", str(tmp_path / "gpu"), PD_PYTHON=str(tmp_path / "no-python"))
    assert missing.returncode == 1 and "run scripts/setup.sh first" in missing.stderr
