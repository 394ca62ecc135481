"""The prefill router's logic with fake prefill servers (no Triton, no network): load-aware
choice, failover on refusal, down / probe / up, errors naming every cause, end-once ordering."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from backends.runtime.sampling_params import SamplingParams
from backends.stages import errors
from backends.stages.request import StageRequest
from backends.stages.router import NoPrefillServer, PrefillRouter, Refused, ServerState


class FakeForward:
    def __init__(self, client, req, on_end):
        self.client, self.req, self.on_end = client, req, on_end

    def answer(self, timeout):
        if self.client.refuse:
            raise Refused(self.client.refuse, down=self.client.down)
        return self.req.with_bootstrap(self.client.bootstrap)


class FakeClient:
    def __init__(self, host, grpc_port, metrics_port):
        self.name = f"{host}:{grpc_port}"
        self.bootstrap = f"{host}:{grpc_port + 1000}"
        self.queued, self.is_ready, self.refuse, self.down = 0.0, True, "", False
        self.forwards: list[FakeForward] = []
        self.remote_fingerprints = []  # what its metrics publish (pd_deployment_info)

    def forward(self, req, on_end):
        f = FakeForward(self, req, on_end)
        self.forwards.append(f)
        return f

    def ready(self, timeout):
        return self.is_ready

    def queued_tokens(self, timeout):
        if not self.is_ready:
            raise OSError("connection refused")
        return self.queued

    def close(self):
        pass


def make(n=2):
    servers = [("10.0.0.1", 8001 + 100 * i, 8002 + 100 * i) for i in range(n)]
    r = PrefillRouter(servers, 1.0, 3600.0, client=FakeClient)  # no background polls
    return r, [s.client for s in r.servers]


def req(room=7, n=10):
    return StageRequest(room=room, prompt_ids=list(range(1, n + 1)), sampling=SamplingParams())


def poll(r):
    for s in r.servers:
        r._poll_one(s)


def answered(exc: Exception) -> str:
    """The error text a prefill server sends for ``exc`` (triton_glue.exception_response)."""
    return errors.tagged(f"prefill: {exc}", **errors.tag_of(exc))


QUEUE_FULL = answered(errors.Overloaded("queue full"))


def test_routes_to_fewest_queued_prompt_tokens_counting_its_own_since_the_read():
    r, (a, b) = make()
    a.queued, b.queued = 100.0, 10.0
    poll(r)
    routed, name = r.dispatch(req(1, 200))
    assert name == b.name and routed.bootstrap_addr == b.bootstrap
    # b now holds 10 + 200 (its metric has not seen the new request yet) > a's 100
    assert r.dispatch(req(2, 5))[1] == a.name
    st = r.stats()["servers"]
    assert st[b.name]["dispatched"] == 1 and st[b.name]["tokens"] == 200
    assert st[b.name]["load"] == 210.0


def test_a_finished_request_no_longer_counts():
    r, (a, b) = make()
    a.queued = 50.0
    poll(r)
    ends = []
    r.dispatch(req(1, 100), on_end=ends.append)
    assert r.stats()["servers"][b.name]["load"] == 100.0
    b.forwards[-1].on_end(None, False)  # prefill finished the room
    assert ends == [None]
    assert r.stats()["servers"][b.name]["load"] == 0.0
    assert r.dispatch(req(2, 5))[1] == b.name


def test_unreachable_server_is_marked_down_and_the_next_one_answers():
    r, (a, b) = make()
    a.refuse, a.down = "UNAVAILABLE: connection refused", True
    routed, name = r.dispatch(req())
    assert name == b.name and routed.bootstrap_addr == b.bootstrap
    assert r.servers[0].state == ServerState.Down
    assert r.stats()["servers"][a.name]["up"] == 0
    assert r.stats()["servers"][a.name]["refused"] == 1
    assert r.dispatch(req(2))[1] == b.name  # not tried again while down
    assert len(a.forwards) == 1


def test_an_error_answer_moves_on_without_marking_down():
    r, (a, b) = make()
    a.refuse = QUEUE_FULL
    assert r.dispatch(req())[1] == b.name
    assert r.servers[0].state == ServerState.Up


def test_error_names_every_server_when_none_is_left():
    r, (a, b) = make()
    a.refuse, a.down = "no answer in 1s (hung?)", True
    b.refuse, b.down = "UNAVAILABLE: connection refused", True
    with pytest.raises(NoPrefillServer) as e:
        r.dispatch(req())
    assert a.name in str(e.value) and "hung" in str(e.value)
    assert b.name in str(e.value) and "connection refused" in str(e.value)
    with pytest.raises(NoPrefillServer) as e:  # both down now: the reasons are kept
        r.dispatch(req(2))
    assert "down: no answer in 1s (hung?)" in str(e.value)


def test_all_overloaded_is_overloaded():
    r, (a, b) = make()
    a.refuse = b.refuse = answered(errors.Overloaded("64 requests wait"))
    with pytest.raises(errors.Overloaded):
        r.dispatch(req())


def test_refusals_are_told_apart_by_their_tag_not_their_words():
    """An internal error that happens to say "overloaded" or "incompatible deployment" is
    neither; an invalid request is the client's, at once, with the server's param and code."""
    r, (a, b) = make()
    a.refuse = b.refuse = answered(RuntimeError("the KV pool is overloaded with stale pages"))
    with pytest.raises(NoPrefillServer):
        r.dispatch(req())
    a.refuse = answered(RuntimeError("relayed: incompatible deployment: secret differs"))
    b.refuse = QUEUE_FULL
    with pytest.raises(NoPrefillServer):  # one overloaded, one internal: not "retry later"
        r.dispatch(req(2))
    assert [s.state for s in r.servers] == [ServerState.Up] * 2 and r.refusals == {}
    a.refuse = answered(errors.InvalidRequest("prompt too long", "input_ids", "too_long"))
    b.refuse, asked = "", len(b.forwards)
    with pytest.raises(errors.InvalidRequest) as e:
        r.dispatch(req(3))
    assert (e.value.param, e.value.code) == ("input_ids", "too_long")
    assert a.name in str(e.value) and "pd-error" not in str(e.value)
    assert len(b.forwards) == asked  # not tried on the next server: it would say the same


def test_down_server_is_probed_and_taken_back_when_ready():
    r, (a, b) = make()
    a.refuse, a.down = "UNAVAILABLE: connection refused", True
    r.dispatch(req())
    a.is_ready = False
    poll(r)
    assert r.servers[0].state == ServerState.Down
    a.is_ready, a.refuse, a.down = True, "", False
    poll(r)
    assert r.servers[0].state == ServerState.Up
    r.servers[1].client.queued = 500.0
    poll(r)
    assert r.dispatch(req(3))[1] == a.name


def test_metrics_unreachable_marks_down():
    r, (a, b) = make()
    a.is_ready = False  # its metrics read fails too
    poll(r)
    assert r.servers[0].state == ServerState.Down and "metrics" in r.servers[0].reason


def test_on_end_runs_once_after_the_answer_was_delivered_even_when_the_stream_ends_first():
    r, (a,) = make(1)
    order = []

    def deliver(routed):
        a.forwards[-1].on_end("UNAVAILABLE: Socket closed", True)  # lost before delivery ended
        order.append("delivered")

    r.dispatch(req(), on_end=lambda err: order.append(("end", err)), deliver=deliver)
    assert order == ["delivered", ("end", "UNAVAILABLE: Socket closed")]
    assert r.servers[0].state == ServerState.Down  # a lost connection marks the server down
    assert r.stats()["servers"][a.name]["lost"] == 1


def test_a_refused_forward_never_ends_the_request():
    r, (a, b) = make()
    a.refuse, a.down = "no answer in 1s (hung?)", True
    ends = []
    r.dispatch(req(), on_end=ends.append)
    a.forwards[-1].on_end("CANCELLED", False)  # the hung forward's late end
    assert ends == []
    b.forwards[-1].on_end(None, False)
    assert ends == [None]


def test_servers_parameter_parses_and_rejects():
    from backends.stages.params import StageParams

    p = StageParams(prefill_servers="10.0.0.1:8001, 10.0.0.2:9001:9100")
    assert p.servers() == [("10.0.0.1", 8001, 8002), ("10.0.0.2", 9001, 9100)]
    for bad in ("10.0.0.1", "10.0.0.1:x", "h:8001,h:8001", "h:0"):
        with pytest.raises(ValueError, match="prefill_servers"):
            StageParams(prefill_servers=bad)


def make_local(n=2, max_tokens=0, busy=0):
    servers = [("10.0.0.1", 8001 + 100 * i, 8002 + 100 * i) for i in range(n)]
    r = PrefillRouter(
        servers, 1.0, 3600.0, client=FakeClient, local_max_tokens=max_tokens, local_busy_tokens=busy
    )
    return r, [s.client for s in r.servers]


def test_short_prompts_are_prefilled_locally_and_long_ones_forwarded():
    from backends.stages.router import LOCAL

    r, (a, b) = make_local(max_tokens=16)
    ends = []
    routed, name = r.dispatch(req(1, 16), on_end=ends.append)
    assert name == LOCAL and routed.bootstrap_addr == LOCAL and ends == [None]
    assert not a.forwards and not b.forwards
    assert r.dispatch(req(2, 17))[1] in (a.name, b.name)
    assert r.stats()["servers"][LOCAL]["dispatched"] == 1


def test_every_prompt_is_local_while_all_prefill_servers_are_busy():
    from backends.stages.router import LOCAL

    r, (a, b) = make_local(busy=500)
    a.queued, b.queued = 600.0, 900.0
    poll(r)
    assert r.dispatch(req(1, 300))[1] == LOCAL
    a.queued = 100.0
    poll(r)
    assert r.dispatch(req(2, 300))[1] == a.name  # one has room again


def test_local_prefill_when_no_prefill_server_is_left():
    from backends.stages.router import LOCAL

    r, (a,) = make_local(n=1, busy=10_000)
    a.refuse, a.down = "UNAVAILABLE: connection refused", True
    assert r.dispatch(req(1, 300))[1] == LOCAL


def test_colocated_needs_no_prefill_server():
    from backends.stages.router import LOCAL

    r = PrefillRouter([], 1.0, 3600.0, client=FakeClient, local_max_tokens=100_000)
    assert r.dispatch(req(1, 2000))[1] == LOCAL
    with pytest.raises(ValueError, match="at least one prefill server"):
        PrefillRouter([], 1.0, 3600.0, client=FakeClient)


def test_a_dns_name_with_several_addresses_is_one_server_each(monkeypatch):
    """A Kubernetes headless Service: scaling the prefill pool changes the name's addresses."""
    from backends.stages.router import servers as rt

    addrs = {"pd-prefill": ["10.1.0.5", "10.1.0.7"]}
    monkeypatch.setattr(rt.socket, "gethostbyname_ex", lambda h: (h, [], addrs[h]))
    r = PrefillRouter([("pd-prefill", 8001, 8002)], 1.0, 3600.0, client=FakeClient)
    assert sorted(s.name for s in r.servers) == ["10.1.0.5:8001", "10.1.0.7:8001"]
    addrs["pd-prefill"] = ["10.1.0.7", "10.1.0.9"]  # one pod gone, one new
    r._refresh()
    assert sorted(s.name for s in r.servers) == ["10.1.0.7:8001", "10.1.0.9:8001"]
    assert r.dispatch(req())[1] in ("10.1.0.7:8001", "10.1.0.9:8001")


def test_a_forwarded_request_asks_prefill_to_hold_the_call_until_the_room_is_done():
    """Failover needs the forwarded call open until prefill is done with the room (a dying server
    breaks it); the prefill model closes a call with its answer unless asked (the ensemble)."""
    from backends.stages.request import HOLD_PARAM
    from backends.stages.router.client import infer_request

    req = StageRequest(room=7, prompt_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=4))
    msg = infer_request(req, fingerprint="")
    assert msg.parameters[HOLD_PARAM].bool_param is True
    assert msg.parameters["triton_enable_empty_final_response"].bool_param is True
    assert msg.model_name == "prefill" and msg.id == "7"


class FakeStream:
    """A ModelStreamInfer call that yields ``responses`` and then ends."""

    def __init__(self, responses):
        self.responses, self.cancelled = list(responses), False

    def __iter__(self):
        return iter(self.responses)

    def cancel(self):
        self.cancelled = True


class FakeStub:
    def __init__(self, *responses):
        self.responses = responses

    def ModelStreamInfer(self, requests):  # noqa: N802 - the gRPC method's name
        return FakeStream(self.responses)


def _ended_forward(stub, on_end):
    """A Forward over ``stub``; returns once its pump ran ``on_end``."""
    from backends.stages.router.client import Forward

    ran = threading.Event()

    def end(err, down):
        ran.set()
        on_end(err, down)

    Forward(stub, req(), end)
    assert ran.wait(10)
    time.sleep(0.05)  # the pump logs right after on_end returned


def test_an_on_end_that_raises_is_logged_with_the_error_it_was_handling(caplog):
    """The router's on_end marks a lost server down and ends the room for failover: a bug
    there must show in the log, not vanish in the forward's pump thread."""
    from tritonclient.grpc import service_pb2

    def broken(err, down):
        raise KeyError("outstanding room")

    failed = service_pb2.ModelStreamInferResponse(error_message="prefill: overloaded")
    with caplog.at_level(logging.WARNING, logger="backends.stages.router.client"):
        _ended_forward(FakeStub(failed), broken)
    said = [r for r in caplog.records if r.name == "backends.stages.router.client"]
    assert len(said) == 1 and said[0].levelno == logging.ERROR
    assert "prefill: overloaded" in said[0].getMessage()
    assert f"room {req().room}" in said[0].getMessage()
    assert said[0].exc_info is not None and said[0].exc_info[0] is KeyError


def test_a_garbled_answer_is_logged_and_ends_the_forward(caplog):
    from tritonclient.grpc import service_pb2

    garbled = service_pb2.ModelStreamInferResponse()
    garbled.infer_response.raw_output_contents.append(b"\x05\x00\x00\x00junk!")
    ends = []
    with caplog.at_level(logging.WARNING, logger="backends.stages.router.client"):
        _ended_forward(FakeStub(garbled), lambda err, down: ends.append((err, down)))
    assert len(ends) == 1 and ends[0][0].startswith("bad answer") and ends[0][1] is False
    assert any("bad answer" in r.getMessage() for r in caplog.records)


def errors_logged(caplog) -> list:
    return [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_an_error_that_cannot_be_delivered_is_logged_and_the_router_goes_on(caplog):
    """The router stage answers a request it could not route through its response sender; when
    that raises too (the client is gone), the dispatch thread says so and the router goes on."""
    r, (a, b) = make()
    a.refuse = b.refuse = QUEUE_FULL
    delivered = threading.Event()

    def gone(e):
        delivered.set()
        raise RuntimeError("Response sender has been closed")

    with caplog.at_level(logging.ERROR, logger="backends.stages.router.router"):
        r.submit(req(), lambda routed: None, gone)
        assert delivered.wait(10)
        end = time.monotonic() + 10
        while not errors_logged(caplog) and time.monotonic() < end:
            time.sleep(0.01)
    (said,) = errors_logged(caplog)
    assert "queue full" in said.getMessage() and said.exc_info[0] is RuntimeError
    a.refuse = b.refuse = ""
    routed = []
    r.submit(req(8), routed.append, gone)  # the next request is routed as usual
    end = time.monotonic() + 10
    while not routed and time.monotonic() < end:
        time.sleep(0.01)
    assert routed and routed[0].room == 8


# ---- cache-aware routing (issue 47) ------------------------------------------------------------
def cached_router(policy: str, **kw):
    servers = [("10.0.0.1", 8001 + 100 * i, 8002 + 100 * i) for i in range(2)]
    r = PrefillRouter(servers, 1.0, 3600.0, client=FakeClient, page_size=4,
                      route_policy=policy, **kw)  # fmt: skip
    return r, [s.client for s in r.servers]


def chat(turn: int) -> list[int]:
    """A conversation's prompt at ``turn``: a 40-token system prompt plus 8 tokens a turn."""
    return list(range(1, 41)) + list(range(100, 100 + 8 * turn))


def ask(r, room: int, ids: list[int]) -> str:
    routed, name = r.dispatch(StageRequest(room=room, prompt_ids=ids, sampling=SamplingParams()))
    for s in r.servers:  # each answered: prefill's queue drains (no load left behind)
        s.outstanding.clear()
    return name


@pytest.mark.parametrize("policy", ["cache", "queue"])
def test_a_conversation_follows_its_cached_prefix_unless_the_policy_is_queue(policy):
    r, (a, b) = cached_router(policy)
    first = ask(r, 1, chat(1))
    other = ask(r, 2, [7] * 40)  # another conversation: the other server (fewer dispatched)
    assert {first, other} == {a.name, b.name}
    names = [ask(r, 10 + t, chat(t)) for t in range(2, 6)]  # the conversation's next turns
    if policy == "cache":
        assert names == [first] * 4  # where its prefix is
        hits = r.stats()["servers"][first]["hit_tokens"]
        assert hits == sum(4 * (len(chat(t - 1)) // 4) for t in range(2, 6))
    else:
        assert set(names) == {a.name, b.name}  # least queue: the turns alternate
    r.close()


def test_a_long_prompt_whose_prefix_decode_holds_is_prefilled_locally():
    """Conditional disaggregation counts the tokens uncached on decode, not the prompt's."""
    from backends.stages.router import LOCAL

    r, _ = cached_router("cache", local_max_tokens=12, decode_caches=True)
    assert ask(r, 1, chat(1)) != LOCAL  # 48 new tokens: a prefill server
    assert ask(r, 2, chat(2)) == LOCAL  # 56 tokens, but decode likely holds the first 48
    assert ask(r, 3, [5] * 56) != LOCAL  # as long, nothing cached
    assert r.stats()["servers"][LOCAL]["hit_tokens"] == 48
    r.close()


def test_a_decode_server_without_a_cache_is_credited_with_no_hit():
    """prefix_cache=off at decode (or a model it refuses, e.g. an EAGLE head): a repeated long
    prompt still goes to a prefill server, as decode would compute all of it."""
    from backends.stages.router import LOCAL

    r, _ = cached_router("cache", local_max_tokens=12)
    assert [ask(r, t, chat(1)) != LOCAL for t in range(3)] == [True] * 3
    assert r.stats()["servers"][LOCAL]["hit_tokens"] == 0
    r.close()


def test_a_server_that_keeps_no_prefix_cache_gets_no_credit_for_one():
    """Prefill servers with prefix_cache=off export no prefix metric: the router expects no hit
    there, so a conversation is balanced by queue, and its hit counter stays 0."""
    r, (a, b) = cached_router("cache")
    a.caches = b.caches = False
    names = [ask(r, 10 + t, chat(t)) for t in range(1, 5)]
    assert set(names) == {a.name, b.name}
    assert all(r.stats()["servers"][n]["hit_tokens"] == 0 for n in (a.name, b.name))
    r.close()
