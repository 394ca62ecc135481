"""Real tritonserver, real clients: greedy output equals transformers token for token."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from triton_harness import ROOT, grpc_ask, http_generate, http_generate_stream, metrics

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

PROMPTS = [  # (text, chat template, max_tokens)
    ("What is the capital of France?", True, 12),
    ("The three primary colors are", False, 10),
    ("Write a haiku about the sea.", True, 14),
]


@pytest.mark.parametrize("stream", [True, False])
def test_grpc_matches_transformers(server, reference, stream):
    for text, chat, n in PROMPTS:
        fields = {"text_input": text, "max_tokens": n, "apply_chat_template": chat}
        pieces, ids, err = grpc_ask(server.grpc, {**fields, "stream": stream})
        assert err is None
        assert ids == reference.greedy(text, chat, n), text
        assert "".join(pieces) == reference.text(ids)
        assert len(pieces) == (len(ids) if stream else 1)


def test_http_generate_and_stream_match_transformers(server, reference):
    for text, chat, n in PROMPTS[:2]:
        want = reference.greedy(text, chat, n)
        fields = {"text_input": text, "max_tokens": n, "apply_chat_template": chat}
        out = http_generate(server, fields)
        assert out["status"] == 200, out
        assert out["output_ids"] == want and out["text_output"] == reference.text(want)
        events = http_generate_stream(server, {**fields, "stream": True})
        assert all("error" not in e for e in events), events
        ids = [t for e in events for t in _as_list(e["output_ids"])]
        assert ids == want and len(events) == len(want)
        assert "".join(e["text_output"] for e in events) == reference.text(want)


def test_input_ids_bypass_tokenizer(server, reference):
    ids = reference.prompt_ids("The capital of Italy is", False)
    out = http_generate(server, {"input_ids": ids, "max_tokens": 6})
    assert out["status"] == 200, out
    assert out["output_ids"] == reference.greedy("The capital of Italy is", False, 6)


def test_16_concurrent_requests_batched_without_crosstalk(server, reference):
    reqs = []
    for i in range(16):
        words = " ".join(f"item{j}" for j in range(i * 3))  # prompts of different lengths
        text = f"Tell me a fact about the number {i}. Ignore these words: {words}"
        reqs.append((text, i % 2 == 0, 6 + i % 5))
    wants = [reference.greedy(t, c, n) for t, c, n in reqs]
    before = metrics(server)

    def ask(req):
        text, chat, n = req
        return http_generate(
            server, {"text_input": text, "max_tokens": n, "apply_chat_template": chat}
        )

    with ThreadPoolExecutor(16) as ex:
        outs = list(ex.map(ask, reqs))
    for out, want in zip(outs, wants, strict=True):
        assert out["status"] == 200, out
        assert _as_list(out["output_ids"]) == want
    assert sum(len(w) > 1 for w in wants) >= 12  # most of them really decode
    after = metrics(server)
    # shared decode batches (in some decode instance: the session server runs two)
    assert max(_metric_values(server, "pd_decode_max_batch_size", "decode")) > 1
    for stage in ("prefill", "decode"):  # both instances of each stage served requests
        served = _metric_values(server, "pd_requests_total", stage)
        assert len(served) == 2 and min(served) > 0
    assert after[("pd_requests_total", "decode")] - before[("pd_requests_total", "decode")] == 16


def _as_list(v) -> list[int]:
    return v if isinstance(v, list) else [v]  # HTTP renders a one-element tensor as a scalar


def _metric_values(server, name: str, stage: str) -> list[float]:
    """One value per instance of ``stage``."""
    import urllib.request

    with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
        lines = r.read().decode().splitlines()
    tag = f'stage="{stage}"'
    return [float(ln.rsplit(" ", 1)[1]) for ln in lines if ln.startswith(name + "{") and tag in ln]


@pytest.mark.parametrize("http", [False, True])
def test_client_script_answers_paris(server, http):
    url = server.http if http else server.grpc
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "client.py"), "--url", url]
    cmd += ["--http"] if http else []
    cmd += ["What is the capital of France?"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
