"""The router and its prefill servers' deployment identity (fake servers, no network): a server
of another deployment is marked incompatible (from its published fingerprint, or at once from a
refused forward), never routed to, named in the error; the router is not ready while no
compatible server is up, and ready again once one is."""

from __future__ import annotations

import json

import msgspec
import pytest
from test_router import FakeClient, answered, req

from backends.stages.fingerprint import ForwardCheck, Incompatible, from_labels, info_labels
from backends.stages.router import NoPrefillServer, PrefillRouter, ServerState
from kvtransfer.protocol.identity import Fingerprint, key_id

OURS = Fingerprint(5, key_id("B" * 32), "a" * 32, "smollm2", "", "float32/page16")
OTHER_SECRET = msgspec.structs.replace(OURS, key_id=key_id("A" * 32))
OTHER_MODEL = msgspec.structs.replace(OURS, model="b" * 32, model_name="tuned")


def make():
    servers = [("10.0.0.1", 8001, 8002), ("10.0.0.2", 8001, 8002)]
    r = PrefillRouter(servers, 1.0, 3600.0, client=FakeClient, fingerprint=OURS)
    return r, [s.client for s in r.servers]


def poll(r):
    for s in r.servers:
        r._poll_one(s)


def test_published_fingerprints_decide_and_readiness_follows():
    r, (a, b) = make()
    a.remote_fingerprints, b.remote_fingerprints = [OTHER_SECRET], [OTHER_MODEL]
    poll(r)
    assert [s.state for s in r.servers] == [ServerState.Incompatible] * 2
    assert not r.ready and r.stage_stats() == {
        "ready": 0, "refusals": {"secret": 1, "model": 1}
    }  # fmt: skip
    with pytest.raises(NoPrefillServer) as e:
        r.dispatch(req())
    msg = str(e.value)
    assert "10.0.0.1:8001: incompatible deployment: secret differs" in msg
    assert "10.0.0.2:8001: incompatible deployment: model differs: prefill serves tuned" in msg
    assert "down:" not in msg and not a.forwards and not b.forwards  # nothing was forwarded
    a.remote_fingerprints = [OURS]  # restarted with the right secret
    poll(r)
    assert r.ready and r.dispatch(req(2))[1] == a.name
    assert r.stats()["servers"][b.name]["incompatible"] == 1
    r.close()


def test_a_refused_forward_marks_the_server_incompatible_at_once():
    """By the code of prefill's tagged error (what its ForwardCheck raised), not its words."""
    r, (a, b) = make()
    with pytest.raises(Incompatible) as refused:
        ForwardCheck(OTHER_SECRET).check(
            json.dumps({"pd_fingerprint": msgspec.json.encode(OURS).decode()})
        )
    a.refuse = answered(refused.value)
    assert "code=incompatible_deployment.secret" in a.refuse
    a.queued = 0.0
    b.queued = 100.0
    poll(r)
    assert r.dispatch(req(1))[1] == b.name  # a refused, b took it
    assert r.servers[0].state == ServerState.Incompatible
    assert r.dispatch(req(2))[1] == b.name and len(a.forwards) == 1  # never asked again
    assert r.stage_stats()["refusals"] == {"secret": 1}
    r.close()


def test_prefill_checks_the_forwarded_fingerprint():
    check = ForwardCheck(OURS)
    check.check(None)  # a request without one (a client's) is not checked
    check.check(json.dumps({"pd_fingerprint": msgspec.json.encode(OURS).decode()}))
    with pytest.raises(Incompatible, match="incompatible deployment: secret differs"):
        check.check(json.dumps({"pd_fingerprint": msgspec.json.encode(OTHER_SECRET).decode()}))
    newer = msgspec.structs.replace(OURS, protocol=6)
    with pytest.raises(Incompatible, match=r"protocol 5 vs 6 \(prefill vs decode\)"):
        check.check(json.dumps({"pd_fingerprint": msgspec.json.encode(newer).decode()}))
    assert check.merged({"refusals": {"secret": 2}})["refusals"] == {"secret": 3, "protocol": 1}
    labels = {**info_labels(OURS), "stage": "prefill", "instance": "prefill_0_0"}
    assert from_labels(labels) == OURS and "B" * 32 not in json.dumps(labels)
