"""The Triton paged-attention kernel (``backends/runtime/triton_attn.py``) under
``TRITON_INTERPRET=1`` on CPU tensors, against a dense float64 reference: GQA (grouped heads,
sliding window), MLA (latent keys with a rope tail, values = the latent's first channels), fp8
caches with per-layer scales, attention sinks (gpt-oss: a logit per head in the softmax's
denominator, also across decode key splits), float32 / float16 / bfloat16 queries; page sizes 1,
4 and 16, shuffled page tables, mixed lengths; decode, prefill from 0, and prefill
continuations (queries at [start, start + n) over keys [0, start + n), as chunked prefill and
prefix caching need). Through the runtime: tiny models against transformers, gpt-oss's
per-layer windows and sinks among them, and decode steps from CUDA graphs' buffers (Gemma 3's
window views on them).

Triton reads ``TRITON_INTERPRET`` when it is first imported, so the cases
(``tests/helpers/triton_attn_cases.py``) run in processes of their own, its three parts at once
(about 30 s on the 2-core CI machine, against 45 s in one process); each case is its own test
here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import triton_attn_cases as cases

pytest.importorskip("triton")

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(ROOT), env.get("PYTHONPATH", "")])
    script = os.path.join(ROOT, "tests", "helpers", "triton_attn_cases.py")
    procs = [
        subprocess.Popen([sys.executable, script, part], env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for part in cases.PARTS
    ]  # fmt: skip
    merged = {}
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-4000:]
        merged.update(json.loads(out.strip().splitlines()[-1]))
    return merged


@pytest.mark.parametrize(
    "name",
    [
        *cases.suite(),
        *(f"runtime-{k}" for k in cases.RUNTIME_KINDS),
        *(f"graphs-{k}{ops}" for k in cases.GRAPH_KINDS for ops in ("", "-torch-ops")),
        "graphs-llama-fallback",
        "graphs-gemma3",
        *(f"fp8-runtime-{k}" for k in cases.FP8_KINDS),
    ],
)
def test_kernel_matches_float64_reference(results, name):
    r = results[name]
    assert r["error"] is None, r["error"]
    assert r["ref_max"] > 0.5  # a real output (fp8 cases: the scales were applied, not 1.0)
