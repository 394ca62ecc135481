"""Client cancels in every phase, streaming and not, through a real tritonserver whose KV writes
wait 2 s (the kvtransfer fault-injection setting for tests) so each phase lasts long enough:
prefill computing, KV transferring, decoding. (Cancel while queued for pages: test_e2e_overload.)
Each time: the request ends at once, no more tokens are generated, pages go back to 0 on both
stages, and Triton counts no inference left in flight."""

from __future__ import annotations

import glob
import json
import os
import time

import numpy as np
import pytest
from triton_harness import (
    GrpcStream,
    assert_stopped_with_nothing_in_flight,
    grpc_ask,
    grpc_input,
    launch,
    metrics,
    stop,
    wait_pages_free,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def slow(tmp_path_factory):
    sets = ["prefill.lg_fixed_group_size=10", "max_context=2048", "max_tokens_limit=512"]
    env = {"KVTRANSFER_FAULTS": "delay=2"}
    srv, serve, env = launch(tmp_path_factory.mktemp("slow"), sets, env=env)
    yield srv
    stop(srv, serve, env)
    assert_stopped_with_nothing_in_flight(srv)


def ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, 40000, n).tolist()


def trace(server) -> list[dict]:
    out = []
    for path in glob.glob(os.path.join(server.trace_dir, "*.jsonl")):
        with open(path) as f:
            out += [json.loads(line) for line in f if line.strip()]
    return out


def cancel_at(server, fields: dict, after_s: float) -> dict:
    """Send, cancel after ``after_s`` seconds, wait until decode ended it; the metric deltas."""
    before = metrics(server)
    s = GrpcStream(server.grpc)
    s.send([grpc_input(k, v) for k, v in fields.items()])
    time.sleep(after_s)
    s.close(cancel=True)
    key = ("pd_requests_cancelled_total", "decode")
    deadline = time.time() + 15
    while metrics(server).get(key, 0) <= before.get(key, 0):
        assert time.time() < deadline, "decode never ended the cancelled request"
        time.sleep(0.1)
    gen = ("pd_generated_tokens_total", "decode")
    ended = metrics(server)
    time.sleep(1.0)  # nothing more is generated for it (within one step of the cancel)
    after = metrics(server)
    assert after.get(gen, 0) == ended.get(gen, 0)
    m = wait_pages_free(server, 30)
    assert [m[("pd_kv_pages_in_use", st)] for st in ("prefill", "decode")] == [0, 0]
    return {"generated": ended.get(gen, 0) - before.get(gen, 0)}


def prefill_timing(server, n: int) -> tuple[float, float]:
    """(seconds from sending until prefill starts computing, seconds it computes) for an
    ``n``-token prompt on this host, from an uncancelled request's prefill trace record."""
    gen = ("pd_generated_tokens_total", "decode")
    before, sent = metrics(server).get(gen, 0), time.time()
    _, _, err = grpc_ask(server.grpc, {"input_ids": ids(n, 99), "max_tokens": 1})
    assert err is None, err
    deadline = time.time() + 10  # trace records and metrics are written off the hot path
    while True:
        recs = [r for r in trace(server) if r["stage"] == "prefill" and r.get("start", 0) > sent]
        if (recs and metrics(server).get(gen, 0) > before) or time.time() > deadline:
            break
        time.sleep(0.2)
    assert recs and "computed" in recs[0], recs
    return recs[0]["start"] - sent, recs[0]["computed"] - recs[0]["start"]


@pytest.mark.parametrize("stream", [True, False])
def test_cancel_while_prefill_computes(slow, stream):
    # cancel a third into the compute, as measured here: a fixed time raced the host's speed
    start, compute = prefill_timing(slow, 2000)
    fields = {"input_ids": ids(2000, 1), "max_tokens": 16, "stream": stream}
    assert cancel_at(slow, fields, start + compute / 3)["generated"] == 0
    deadline = time.time() + 10
    while True:
        pre = [r for r in trace(slow) if r["stage"] == "prefill" and r.get("error")]
        if any("ended while prefill computed" in r["error"] for r in pre) or time.time() > deadline:
            break
        time.sleep(0.2)
    assert any("ended while prefill computed" in r["error"] for r in pre), pre  # stopped early


@pytest.mark.parametrize("stream", [True, False])
def test_cancel_while_the_kv_transfers(slow, stream):
    fields = {"input_ids": ids(64, 2), "max_tokens": 32, "stream": stream}
    generated = cancel_at(slow, fields, 1.2)["generated"]  # computed, KV still in flight
    # streaming: at most the first token, which prefill sends before the KV lands (issue 12)
    assert generated in ((0, 1) if stream else (0,))
    recs = trace(slow)
    dec = [r for r in recs if r["stage"] == "decode" and r["cancelled"]][-1]
    pre = next(r for r in recs if r["stage"] == "prefill" and r["room"] == dec["room"])
    assert pre["error"] is None and "computed" in pre  # prefill had finished computing


@pytest.mark.parametrize("stream", [True, False])
def test_cancel_while_decoding(slow, stream):
    fields = {"input_ids": ids(32, 3), "max_tokens": 400, "ignore_eos": True, "stream": stream}
    generated = cancel_at(slow, fields, 6.0)["generated"]  # 2 s of transfer delay, then decode
    assert 0 < generated < 400


def test_the_server_serves_on(slow):
    _, out, err = grpc_ask(slow.grpc, {"text_input": "Hello", "max_tokens": 3})
    assert err is None and out
