"""Deployment identity at first contact (protocol 5): a prefill refuses, at once and naming the
field, a decode with another secret, another model or another protocol version; the room fails
in seconds instead of after the bootstrap timeout, and every page is freed exactly once."""

import time

import pytest
import zmq

from kvtransfer import messages as m
from kvtransfer.protocol.identity import Identity

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ENTRIES = {"target": ("gqa", 16, 64)}
SMOL = Identity("a" * 32, "smollm2", "", "bfloat16/page16")
OTHER = Identity("b" * 32, "smollm2-finetune", "", "bfloat16/page16")
SECRET_A, SECRET_B = "A" * 32, "B" * 32


def _register(prefill, decode, room):
    prefill.alloc_pages(room, {"target": 6})
    decode.alloc_pages(room, {"target": 8})
    decode.register(room, [prefill.info["bootstrap_addr"]], 90)


def test_other_secret_is_refused_at_once(spawn):
    prefill = spawn("prefill", ENTRIES, shared_secret=SECRET_A, identity=SMOL)
    # a short transfer timeout: the refused room's pages (a hint: not proven unwritten) wait
    # in quarantine at most that long
    decode = spawn("decode", ENTRIES, shared_secret=SECRET_B, identity=SMOL, transfer_timeout_s=2.0)
    free0 = decode.free_counts()
    t0 = time.monotonic()
    _register(prefill, decode, 1)
    while decode.status(1) != "Failed":
        assert time.monotonic() - t0 < 5, "no refusal within 5 s (bootstrap timeout is 20 s)"
        time.sleep(0.05)
    status, reason = decode.wait(1, 10)
    assert status == "Failed"
    assert "incompatible deployment: secret differs" in reason
    assert "prefill key id" in reason and "decode key id" in reason
    assert SECRET_A not in reason and SECRET_B not in reason
    assert decode.free_counts() == free0  # released after the quarantine bound
    assert decode.stats()["refusals"] == {"secret": 1}
    assert prefill.stats()["refusals"] == {"secret": 1}


def test_other_model_is_refused_at_once(spawn):
    prefill = spawn("prefill", ENTRIES, shared_secret=SECRET_A, identity=OTHER)
    decode = spawn("decode", ENTRIES, shared_secret=SECRET_A, identity=SMOL)
    free0 = (prefill.free_counts(), decode.free_counts())
    t0 = time.monotonic()
    _register(prefill, decode, 1)
    prefill.start_room(1)
    d_status, d_reason = decode.wait(1, 10)
    p_status, p_reason = prefill.wait(1, 10)
    assert time.monotonic() - t0 < 5
    assert d_status == p_status == "Failed"
    for reason in (d_reason, p_reason):
        assert "model differs: prefill serves smollm2-finetune (bbbb" in reason
        assert "decode serves smollm2 (aaaa" in reason
    assert (prefill.free_counts(), decode.free_counts()) == free0
    assert decode.stats()["refusals"] == prefill.stats()["refusals"] == {"model": 1}


def test_other_protocol_version_gets_an_unsigned_refuse(spawn):
    prefill = spawn("prefill", ENTRIES, shared_secret=SECRET_A, identity=SMOL)
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://{prefill.info['bootstrap_addr']}")
        reg = m.Register(7, "127.0.0.1:1", [], 16)
        payload = m._env_enc.encode(reg)  # a future version's Register, signed by its rules
        s.send(m._env_enc.encode(m.Envelope(m.PROTOCOL_VERSION + 1, time.time(), payload, b"x")))
        assert s.poll(5000), "no answer to a Register of another protocol version"
        hint = m.peek_refusal(s.recv())
        assert hint is not None and hint.room == 7 and hint.protocol == m.PROTOCOL_VERSION
        want = f"protocol {m.PROTOCOL_VERSION} vs {m.PROTOCOL_VERSION + 1} (prefill vs decode)"
        assert hint.reason == f"incompatible deployment: {want}"
        with pytest.raises(m.MessageError, match="not signed"):
            m.decode(m.encode_unsigned(hint), SECRET_A.encode())  # never a trusted message
    finally:
        ctx.destroy(linger=0)
    assert prefill.stats()["refusals"] == {"protocol": 1}


def test_prefill_without_secret_refuses_a_signing_decode(spawn):
    """A prefill started with no secret reads decode's Register (it checks no MAC) but sees
    another key id: its answer must be one decode can read without a MAC."""
    prefill = spawn("prefill", ENTRIES, identity=SMOL)
    decode = spawn("decode", ENTRIES, shared_secret=SECRET_B, identity=SMOL, transfer_timeout_s=1.0)
    t0 = time.monotonic()
    _register(prefill, decode, 1)
    status, reason = decode.wait(1, 10)
    assert status == "Failed" and time.monotonic() - t0 < 5
    assert "secret differs (prefill key id none, decode key id" in reason


def test_decode_without_secret_hears_a_signing_prefill(spawn):
    """The other way round: decode signs nothing, prefill drops its Registers as unsigned and
    answers Refuse, which decode (no secret: nothing to verify) reads as the same hint."""
    prefill = spawn("prefill", ENTRIES, shared_secret=SECRET_A, identity=SMOL)
    decode = spawn("decode", ENTRIES, identity=SMOL, transfer_timeout_s=1.0)
    t0 = time.monotonic()
    _register(prefill, decode, 1)
    status, reason = decode.wait(1, 10)
    assert status == "Failed" and time.monotonic() - t0 < 5
    assert "incompatible deployment: secret differs" in reason and "decode key id none" in reason
