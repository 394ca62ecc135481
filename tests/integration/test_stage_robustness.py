"""Stage cores without Triton, real Mooncake (prefill in its own process): a prefill batch that
raises ends exactly its rooms at once on both stages, and a stage that closes under a forward or
a step in progress waits for it (bounded), then aborts, and never closes what that thread uses.

Every wait on the client's side is far shorter than ``transfer_timeout_s`` (``LONG_S``): a room
left to its timeout would fail these tests, not pass them late."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
from runtime_models import checkpoint, hf_greedy, random_prompt
from stagepeer import Collector, PrefillProcess, tiny_params

from backends.runtime.sampling_params import SamplingParams
from backends.stages.decode import DecodeWorker
from backends.stages.params import StageParams
from backends.stages.request import StageRequest
from backends.stages.router import LOCAL

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

LONG_S = 120.0  # transfer_timeout_s: what a client would wait for a room nobody aborted
SOON_S = 20.0  # what it may wait here


def params(**kw) -> dict:
    return tiny_params(checkpoint("llama"), transfer_timeout_s=LONG_S, **kw)


def request(room: int, ids: list[int], addr: str, max_tokens: int = 4) -> StageRequest:
    sp = SamplingParams(max_tokens=max_tokens)
    return StageRequest(room=room, prompt_ids=ids, sampling=sp, bootstrap_addr=addr, stream=True)


@contextlib.contextmanager
def stages(**faults):
    """(a prefill process with ``faults`` (stagepeer.PrefillProcess), a decode worker here)."""
    prefill = PrefillProcess(**faults, **params())
    decode = DecodeWorker(StageParams(**params()))
    try:
        yield prefill, decode
    finally:
        decode.close()
        prefill.stop()


def submit(decode: DecodeWorker, prefill: PrefillProcess, prompts) -> list[Collector]:
    """Decode registers each (room, prompt) with ``prefill``: its clients."""
    clients = [Collector() for _ in prompts]
    for (room, ids), c in zip(prompts, clients, strict=True):
        decode.submit(request(room, ids, prefill.addr), c)
    return clients


def greedy(prompts, clients: list[Collector]) -> None:
    """Each client got its prompt's reference tokens and no error."""
    for (_, ids), c in zip(prompts, clients, strict=True):
        assert c.done.wait(60) and c.events[-1].error is None, c.events[-1]
        assert c.ids == hf_greedy("llama", ids, 4)


def pages_back(decode: DecodeWorker, prefill: PrefillProcess, within: float = 10.0) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        if decode.pages_in_use == 0 and prefill.pages_in_use() == 0:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("where", ["first_tokens", "batch"])
def test_a_prefill_batch_that_raises_aborts_its_rooms_and_decode_hears_at_once(where):
    """``first_tokens``: the batch's logprobs raise after the forward (each room of the batch
    fails, as a room failure); ``batch``: the compute thread's batch raises outside the forward
    (an unexpected error: counted). Either way both rooms of the batch are aborted: decode's
    clients hear the error at once, every page on both sides is back, the stage goes on."""
    with stages(batch_of=2, fail_batch=where) as (prefill, decode):
        prompts = [(501, random_prompt(9, seed=1)), (502, random_prompt(14, seed=2))]
        clients = submit(decode, prefill, prompts)
        t0 = time.monotonic()
        results, sizes = prefill.submit_all(prompts)
        assert sizes[0] == 2  # one batch
        assert all(err and "injected failure" in err for _, err in results), results
        for c in clients:
            assert c.done.wait(SOON_S), "decode still waits for a room prefill gave up"
            assert "injected failure" in (c.events[-1].error or ""), c.events[-1]
        assert time.monotonic() - t0 < SOON_S
        assert pages_back(decode, prefill), (decode.pages_in_use, prefill.pages_in_use())
        # a failing batch is a room failure (first_tokens), an unexpected one counted (batch)
        assert prefill.stats()["loop_errors"] == (1 if where == "batch" else 0)

        prompts = [(503, random_prompt(11, seed=3)), (504, random_prompt(6, seed=4))]
        clients = submit(decode, prefill, prompts)
        results, _ = prefill.submit_all(prompts)
        assert [err for _, err in results] == [None, None]
        greedy(prompts, clients)
        assert pages_back(decode, prefill)


def test_the_prefill_compute_loop_survives_an_error_of_its_own():
    """The compute loop's pick of a batch raises once: the thread goes on (counted), and the
    request it was about to take is computed as usual."""
    with stages(fail_batch="take") as (prefill, decode):
        prompts = [(521, random_prompt(10, seed=8))]
        clients = submit(decode, prefill, prompts)
        results, _ = prefill.submit_all(prompts)
        assert [err for _, err in results] == [None], results
        greedy(prompts, clients)
        assert prefill.stats()["loop_errors"] == 1
        assert pages_back(decode, prefill)


def test_prefill_close_under_a_stuck_forward_aborts_its_rooms_and_keeps_the_sender_open():
    """A forward still running past close's bound (a hung kernel): its room and a queued one
    end Failed at once (decode's client hears it, pages come back), and the KV sender the
    forward still uses is not closed under it."""
    with stages(slow_forward_s=10.0) as (prefill, decode):
        prompts = [(601, random_prompt(9, seed=5))]
        (c,) = submit(decode, prefill, prompts)
        prefill.submit([*prompts, (602, random_prompt(5, seed=6))])  # 602: never registered
        info = prefill.close(join_s=1.0)
        assert info["compute_alive"] and "forward_returned" not in info
        assert "sender_closed" not in info, "the sender was closed under a running forward"
        assert info["close_returned"] - info["close_called"] < 7.0  # 1 s bound + drain
        assert info["status"] == {601: "Failed", 602: "Failed"}
        assert all("shutting down" in err for _, err in info["results"].values()), info
        assert c.done.wait(SOON_S) and "shutting down" in (c.events[-1].error or "")
        assert time.time() - info["close_returned"] < SOON_S
        assert pages_back(decode, prefill)


def test_prefill_close_waits_for_the_forward_in_progress_then_closes_the_sender():
    """A forward that ends within close's bound finishes its room (decode gets its tokens); the
    queued room is aborted; the sender closes only after the forward returned."""
    with stages(slow_forward_s=2.0) as (prefill, decode):
        prompts = [(611, random_prompt(9, seed=5))]
        clients = submit(decode, prefill, prompts)
        prefill.submit([*prompts, (612, random_prompt(5, seed=6))])
        info = prefill.close(join_s=60.0)
        assert not info["compute_alive"]
        assert info["forward_returned"] <= info["sender_closed"] <= info["close_returned"]
        assert info["status"] == {611: "Success", 612: "Failed"}
        assert info["results"][611][1] is None and "shutting down" in info["results"][612][1]
        greedy(prompts, clients)
        assert pages_back(decode, prefill)


def test_decode_close_under_a_stuck_step_ends_its_requests_and_keeps_the_receiver_open():
    decode = DecodeWorker(StageParams(**params()))
    in_step, release = threading.Event(), threading.Event()
    step, receiver_close = decode.engine.step, decode.receiver.close
    closed: list[float] = []

    def stuck_step():
        in_step.set()
        release.wait(60)
        return step()

    decode.engine.step = stuck_step
    decode.receiver.close = lambda: closed.append(time.monotonic())
    try:
        c = Collector()
        decode.submit(request(701, random_prompt(7, seed=7), LOCAL, max_tokens=8), c)
        assert in_step.wait(60)
        t0 = time.monotonic()
        decode.close(join_s=1.0)
        assert time.monotonic() - t0 < 5.0
        assert closed == [], "the receiver was closed under a running step"
        assert c.done.is_set() and "shutting down" in (c.events[-1].error or "")
        n = len(c.events)
        release.set()  # the step ends: nothing more reaches the ended request
        decode._thread.join(10)
        assert not decode._thread.is_alive() and len(c.events) == n
    finally:
        release.set()
        receiver_close()
