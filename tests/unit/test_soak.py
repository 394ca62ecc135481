"""The soak's verdict on error messages: every message the stages send for a failed transfer
counts as clear (a CI soak failed on the first-token form), and a message without a cause does
not; the request after the run is sent again only when a fault was injected into it."""

from benchmarks.soak import classify


def test_every_transfer_failure_form_is_clear():
    for msg in [
        "in ensemble 'ensemble', KV transfer failed: prefill 127.0.0.1:1: transfer failed: x",
        "KV transfer failed after the first token was streamed: prefill 127.0.0.1:32875: "
        "transfer failed: target layers 0-29 to 127.0.0.1:16862",
        "KV transfer failed (prefill gone); re-dispatching it failed too: no prefill ready",
    ]:
        assert classify(msg) == "transfer", msg


def test_other_clear_kinds_and_an_unclear_one():
    assert classify("server overloaded, retry later") == "overloaded"
    assert classify("prefill failed: bad ids") == "prefill"
    for msg in [
        "registering KV pages with prefill failed: no prefill server answered in 5s",
        "decode could not take the prefilled request: prompt too long",
        "decode could not take the request: no free pages",
        "decode failed for this request: index out of range",
    ]:
        assert classify(msg) == "decode", msg
    assert classify("decode failed for this request: ") is None
    assert classify("KV transfer failed") is None  # no cause named
    assert classify("KV transfer failed after something: ") is None
    assert classify("internal error") is None


def _end(**kw):
    return {"pages_in_use": [0, 0], "pages_quarantined": 0, "held": {"x": 0}, "ready": True,
            "probe_ok": True, **kw}  # fmt: skip


def test_the_fronts_verdict_compares_text_and_token_count_and_wants_openais_error_shape():
    from benchmarks.soak import Outcome, summarize

    key, ids = ((5, 6), 4), [7, 8, 9, 2]
    refs, texts = {key: ids}, {key: "Paris."}
    req = {"i": 0, "ids": [5, 6], "max_tokens": 4}
    shaped = {"message": "KV transfer failed: prefill x: injected", "type": "server_error",
              "param": None, "code": "internal_error"}  # fmt: skip
    died = {**shaped, "message": "in ensemble 'ensemble', Stub process 'p' is not healthy."}
    lost = Outcome(req, "error", [], died["message"], 0.5, status=500, body=died)
    good = [
        Outcome(req, "ok", [], "", 1.0, "Paris.", 4),
        Outcome(req, "cancelled", [], "", 0.5, "Par"),
        Outcome(req, "error", [], shaped["message"], 0.5, status=500, body=shaped),
        Outcome(req, "error", [], shaped["message"], 0.5, body=shaped),  # an SSE error event
    ]
    r = summarize(good, refs, texts, _end(), 123, 9.0)
    assert r["ok"] and r["errors_by_status"] == {"500": 1, "stream event": 1}
    for bad, check in [
        (Outcome(req, "ok", [], "", 1.0, "Paris.", 3), "outputs_equal_reference"),  # count
        (Outcome(req, "ok", [], "", 1.0, "Rome.", 4), "outputs_equal_reference"),
        (Outcome(req, "cancelled", [], "", 0.5, "Rom"), "outputs_equal_reference"),
        (Outcome(req, "error", [], shaped["message"], 0.5, status=500, body={"detail": "x"}),
         "errors_in_openai_shape"),  # fmt: skip
        (Outcome(req, "hang", [], "no answer in time", 300.0), "no_hang"),
        (lost, "no_request_lost_to_the_killed_instance"),  # the front tries it again
    ]:
        r = summarize([*good, bad], refs, texts, _end(), 123, 9.0)
        assert not r["ok"] and not r["checks"][check], check
    held = summarize(good, refs, texts, _end(held={"front_requests_in_flight": 1}), 123, 9.0)
    assert not held["checks"]["no_request_held_at_end"]
    grpc = summarize([Outcome(req, "ok", ids, "", 1.0)], refs, None, _end(), 123, 9.0)
    assert grpc["ok"] and "errors_in_openai_shape" not in grpc["checks"]


def test_shared_prefixes_start_every_prompt_and_leave_the_default_plan_alone():
    import argparse
    import random

    from benchmarks.soak import plan, shared_prefixes

    kw = dict(requests=40, distinct=10, max_prompt=100, max_new=12, cancel_share=0.1)
    plain = plan(argparse.Namespace(**kw, shared_prefix=0, prefixes=4), random.Random(0))
    shared = plan(argparse.Namespace(**kw, shared_prefix=50, prefixes=3), random.Random(0))
    prefixes = shared_prefixes(50, 3)
    assert [len(p) for p in prefixes] == [50, 55, 60]  # pages filled to different offsets
    for a, b in zip(plain, shared, strict=True):  # the same draws, each prompt prefixed
        assert any(b["ids"] == p + a["ids"] for p in prefixes)
        assert {**a, "ids": None} == {**b, "ids": None}
    assert len({tuple(r["ids"][:50]) for r in shared}) > 1  # more than one prefix in use
    assert shared_prefixes(0, 4) == []


def test_the_probe_after_the_run_is_resent_only_after_an_injected_transfer_fault():
    """The faults stay injected after the run (5 % of rooms), so a probe that got one is sent
    again (a full suite failed on it); any other error or a wrong output fails at once."""
    from benchmarks.soak import Outcome, probe_after

    req = {"i": -1, "ids": [5], "max_tokens": 2}
    fault = Outcome(req, "error", [], "KV transfer failed: prefill x: injected fault", 0.1)
    died = Outcome(req, "error", [], "Stub process 'prefill_0_0' is not healthy.", 0.1)
    ok, wrong = Outcome(req, "ok", [7, 8], "", 0.1), Outcome(req, "ok", [7, 9], "", 0.1)

    def run(*outcomes):
        it = iter(outcomes)
        return probe_after(lambda r, t: next(it), req, 5.0, lambda o: o.ids == [7, 8])

    assert run(ok) == {"ok": True, "attempts": ["ok"]}
    assert run(fault, ok)["ok"] and len(run(fault, fault, ok)["attempts"]) == 3
    assert not run(fault, fault, fault, ok)["ok"]  # three attempts at most
    assert run(died, ok) == {"ok": False, "attempts": [f"error: {died.error}"]}
    assert not run(fault, wrong)["ok"]
