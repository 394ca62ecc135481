"""Overload through a real tritonserver whose decode pool holds ONE long request at a time:
waiting for pages is backpressure, never a failure (even far past bootstrap_timeout_s); past
max_queue a request gets 'overloaded, retry later' at once (gRPC UNAVAILABLE; HTTP generate
answers 400 or 503 depending on the endpoint's error mapping, docs/serving.md)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from triton_harness import (
    MODEL,
    GrpcStream,
    assert_stopped_with_nothing_in_flight,
    grpc_ask,
    grpc_input,
    http_generate,
    launch,
    metrics,
    stop,
    wait_pages_free,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

PROMPT, NEW = 380, 48  # 380 + 48 - 1 tokens = 27 pages of 16: one such request fills the pool
MAX_QUEUE = 8


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    sets = [
        "decode.num_pages=30",  # one long request at a time
        "prefill.num_pages=64",
        "bootstrap_timeout_s=5",
        f"max_queue={MAX_QUEUE}",
        "max_context=512",
        "max_tokens_limit=256",
    ]
    srv, serve, env = launch(tmp_path_factory.mktemp("small"), sets)
    yield srv
    stop(srv, serve, env)
    # a request decode refused at once (the last test) once left its ensemble request in
    # flight for good: prefill's step now closes with its answer
    assert_stopped_with_nothing_in_flight(srv)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, 40000, PROMPT).tolist() for _ in range(n)]


def colocated(ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The reference: the same runtime, colocated (checked against transformers elsewhere)."""
    import torch

    from backends.runtime.engine import LLMEngine
    from backends.runtime.loader import load_runner
    from backends.runtime.sampling_params import SamplingParams

    torch.set_num_threads(1)
    runner = load_runner(MODEL)
    engine = LLMEngine(runner, runner.make_pool(len(ids) * 28, 16), max_batch=len(ids))
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return [s.output_ids for s in engine.generate([(p, sp) for p in ids])]


def ask(server, ids, stream=False, max_tokens=NEW):
    fields = {"input_ids": ids, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    return grpc_ask(server.grpc, fields, timeout=600)


def test_eight_concurrent_long_requests_wait_and_all_succeed(small):
    ids = prompts(8, seed=1)
    t0 = time.time()
    with ThreadPoolExecutor(8) as ex:
        outs = list(ex.map(lambda p: ask(small, p), ids))
    waited = time.time() - t0
    assert [err for _, _, err in outs] == [None] * 8
    assert [got for _, got, _ in outs] == colocated(ids, NEW)
    assert waited > 5  # the last ones waited longer than bootstrap_timeout_s, and succeeded
    m = wait_pages_free(small)
    assert [m[("pd_kv_pages_in_use", s)] for s in ("prefill", "decode")] == [0, 0]
    assert m.get(("pd_requests_failed_total", "decode"), 0) == 0


def test_past_the_queue_bound_requests_are_refused_at_once_and_the_server_recovers(small):
    before = metrics(small)
    running = GrpcStream(small.grpc)  # occupies the pool, streaming
    fields = {"input_ids": prompts(1, 2)[0], "max_tokens": 100, "ignore_eos": True, "stream": True}
    running.send([grpc_input(k, v) for k, v in fields.items()])
    assert running.next(120)[3] is None  # it is decoding
    queued = [GrpcStream(small.grpc) for _ in range(MAX_QUEUE)]
    for s, p in zip(queued, prompts(MAX_QUEUE, 3), strict=True):
        s.send([grpc_input(k, v) for k, v in {"input_ids": p, "max_tokens": NEW}.items()])
    time.sleep(2.0)  # all queued at decode, waiting for pages
    t0 = time.time()
    _, _, err = ask(small, prompts(1, 4)[0])  # (gRPC streaming carries no status code per
    assert err is not None and "overloaded, retry later" in err, err  # response: the text)
    out = http_generate(small, {"input_ids": prompts(1, 5)[0], "max_tokens": NEW})
    # the stage answers UNAVAILABLE; Triton 2.51's ensemble re-wraps a step's error, so the
    # generate endpoint says 400 (docs/serving.md): the message is what a client can rely on
    assert out["status"] in (400, 503) and "overloaded, retry later" in out["error"], out
    refused_in = time.time() - t0
    assert refused_in < 30  # at once: long before the running request could have finished

    def overloaded(m):  # prefill's queue or decode's queue refused it (both bound max_queue)
        return sum(m.get(("pd_requests_overloaded_total", s), 0) for s in ("prefill", "decode"))

    deadline = time.time() + 10  # the stages refresh their metrics every 0.25 s
    while overloaded(metrics(small)) < overloaded(before) + 2:
        assert time.time() < deadline, "the refusals were not counted"
        time.sleep(0.25)
    piece, ids, final, err = running.next(120)  # the running request was not disturbed
    assert err is None and ids
    for s in [running, *queued]:  # give the queue back
        s.close(cancel=True)
    m = wait_pages_free(small, 60)
    assert [m[("pd_kv_pages_in_use", s)] for s in ("prefill", "decode")] == [0, 0]
    ok = grpc_ask(small.grpc, {"text_input": "Hello", "max_tokens": 4})  # recovered
    assert ok[2] is None and ok[1]


def test_cancel_while_queued_for_pages_ends_it_and_spares_the_others(small):
    a_ids, b_ids = prompts(2, seed=6)
    result: dict = {}

    def run_a():
        result["a"] = ask(small, a_ids)

    t = threading.Thread(target=run_a)
    t.start()
    time.sleep(1.5)  # A holds the pool
    for stream in (True, False):
        s = GrpcStream(small.grpc)
        fields = {"input_ids": b_ids, "max_tokens": NEW, "ignore_eos": True, "stream": stream}
        s.send([grpc_input(k, v) for k, v in fields.items()])
        time.sleep(1.0)  # B waits for pages (prefill has not computed it)
        before = metrics(small).get(("pd_requests_cancelled_total", "decode"), 0)
        s.close(cancel=True)
        deadline = time.time() + 10
        while metrics(small).get(("pd_requests_cancelled_total", "decode"), 0) <= before:
            assert time.time() < deadline, "the queued request was not cancelled"
            time.sleep(0.2)
    t.join(300)
    assert result["a"][2] is None and result["a"][1] == colocated([a_ids], NEW)[0]
    m = wait_pages_free(small, 30)
    assert [m[("pd_kv_pages_in_use", s)] for s in ("prefill", "decode")] == [0, 0]


def test_a_request_the_decode_pool_can_never_hold_is_refused_at_once(small):
    ids = np.random.default_rng(7).integers(10, 40000, 300).tolist()
    # 300 + 200 - 1 tokens fit max_context (512) but need 32 pages of 16; the decode pool has 30
    _, got, err = grpc_ask(small.grpc, {"input_ids": ids, "max_tokens": 200}, timeout=60)
    assert err is not None and "can never run here" in err and "30" in err, err
    assert not got
    m = wait_pages_free(small, 60)
    assert [m[("pd_kv_pages_in_use", s)] for s in ("prefill", "decode")] == [0, 0]
    ok = grpc_ask(small.grpc, {"text_input": "Hello", "max_tokens": 4})
    assert ok[2] is None and ok[1]
