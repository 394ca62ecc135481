"""Which room failures decode's failover re-dispatches (no network: a fake router): a KV checksum
mismatch and a prefill server of another deployment are re-dispatched under a fresh room (the
router then skips an incompatible server); decode's own abort is not."""

from __future__ import annotations

import threading
from collections import deque
from types import SimpleNamespace

from backends.runtime.sampler import SamplingParams
from backends.stages.decode_failover import DecodeFailover
from backends.stages.decode_state import ActiveRequest, Phase
from backends.stages.request import StageRequest


class Fake(DecodeFailover):
    name, _stop = "decode", False

    def __init__(self):
        self.counters, self.params = {"failovers": 0}, SimpleNamespace(failover_attempts=3)
        self.router = SimpleNamespace(dispatch=lambda req: (req.with_bootstrap("10.0.0.2:1"), "s"))
        self._cond, self._rerouted = threading.Condition(), deque()
        self._reroute_pool = SimpleNamespace(submit=lambda fn, *a: fn(*a))


def active(room=7):
    req = StageRequest(room=room, prompt_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=4))
    r = ActiveRequest(req.with_bootstrap("10.0.0.1:1"), lambda ev: None, None)
    r.phase = Phase.TRANSFER
    return r


def test_checksum_mismatch_and_incompatible_prefill_are_re_dispatched():
    f = Fake()
    for reason in (
        "KV checksum mismatch: target layer 0 (prefill 1a2b3c4d, decode 1a2b3c4e): ...",
        "prefill 10.0.0.1:1: incompatible deployment: model differs: prefill serves x, decode y",
    ):
        r = active()
        assert f._retry(r, reason)
        nxt, err = f._rerouted.popleft()
        assert err is None and nxt.req.room != r.req.room and nxt.client_room == r.req.room
        assert nxt.req.bootstrap_addr == "10.0.0.2:1" and r.phase == Phase.DONE
    assert f.counters["failovers"] == 2
    assert not f._retry(active(), "aborted by decode: client cancelled")


def test_the_re_dispatched_request_keeps_its_detokenizer():
    """The multihost SIGKILL test once got every re-dispatched request's token ids right and its
    text empty: the fresh request had no detokenizer."""
    f, r = Fake(), active()
    r.text = object()  # a TextState that has seen the tokens streamed so far
    assert f._retry(r, "prefill peer lost: 10.0.0.1:1 silent for 5.0s")
    nxt, _ = f._rerouted.popleft()
    assert nxt.text is r.text
