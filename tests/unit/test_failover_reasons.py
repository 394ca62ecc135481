"""Which room failures decode's failover re-dispatches (no network: a fake router): a KV checksum
mismatch and a prefill server of another deployment are re-dispatched under a fresh room (the
router then skips an incompatible server); decode's own abort is not, whatever its words (the
request's state decides)."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from backends.runtime.sampling_params import SamplingParams
from backends.stages.decode.failover import Failover
from backends.stages.decode.state import ActiveRequest, Phase
from backends.stages.request import StageRequest


def failover() -> tuple[Failover, deque]:
    """A Failover whose router always answers 10.0.0.2:1, re-dispatching on the calling thread;
    and the (request, error) pairs it hands back to the loop."""
    rerouted: deque = deque()
    router = SimpleNamespace(dispatch=lambda req: (req.with_bootstrap("10.0.0.2:1"), "s"))
    f = Failover(
        router,
        attempts=3,
        on_rerouted=lambda nxt, err: rerouted.append((nxt, err)),
        stopping=lambda: False,
        executor=SimpleNamespace(submit=lambda fn, *a: fn(*a)),
    )
    return f, rerouted


def active(room=7):
    req = StageRequest(room=room, prompt_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=4))
    r = ActiveRequest(req.with_bootstrap("10.0.0.1:1"), lambda ev: None, None)
    r.phase = Phase.TRANSFER
    return r


def test_checksum_mismatch_and_incompatible_prefill_are_re_dispatched():
    f, rerouted = failover()
    for reason in (
        "KV checksum mismatch: target layer 0 (prefill 1a2b3c4d, decode 1a2b3c4e): ...",
        "prefill 10.0.0.1:1: incompatible deployment: model differs: prefill serves x, decode y",
    ):
        r = active()
        assert f.retry(r, reason)
        nxt, err = rerouted.popleft()
        assert err is None and nxt.req.room != r.req.room and nxt.client_room == r.req.room
        assert nxt.req.bootstrap_addr == "10.0.0.2:1" and r.phase == Phase.DONE
    assert f.counters["failovers"] == 2
    cancelled = active()
    cancelled.cancelled = True  # decode aborted its room for the client's cancel
    assert not f.retry(cancelled, "aborted by decode: client cancelled")
    gone = active()
    gone.phase = Phase.DONE  # the client went away: decode ended it, then aborted the room
    assert not f.retry(gone, "prefill peer lost: 10.0.0.1:1 silent for 5.0s")
    assert f.counters["failovers"] == 2 and not rerouted


def test_the_re_dispatched_request_keeps_its_detokenizer():
    """The multihost SIGKILL test once got every re-dispatched request's token ids right and its
    text empty: the fresh request had no detokenizer."""
    (f, rerouted), r = failover(), active()
    r.text = object()  # a TextState that has seen the tokens streamed so far
    assert f.retry(r, "prefill peer lost: 10.0.0.1:1 silent for 5.0s")
    nxt, _ = rerouted.popleft()
    assert nxt.text is r.text
