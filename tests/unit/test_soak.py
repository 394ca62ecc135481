"""The soak's verdict on error messages: every message the stages send for a failed transfer
counts as clear (a CI soak failed on the first-token form), and a message without a cause does
not."""

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
