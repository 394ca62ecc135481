"""Control messages: round trips, and every kind of bad frame is rejected with a typed error."""

import hashlib
import hmac
import pathlib
import random
import re
import struct
import time

import msgspec
import pytest

from kvtransfer import messages as m
from kvtransfer.protocol.identity import Fingerprint

SECRET = b"s" * 32
SAMPLES = [
    m.Register(
        7,
        "127.0.0.1:1234",
        [m.EntrySpec("target", {"attn": "gqa", "page_size": 16}, [3, 1, 2], 1 << 40, 128)],
        300,
    ),
    m.Ack(7, {"target": {"attn": "mla", "num_layers": 61}}),
    m.Complete(7, 42, {"a": 1, "b": 0.5, "c": "x", "d": [1, 2.0, "y"]}),
    m.Complete(2**62, 0),
    m.Fail(7, "incompatible layout: head_dim"),
    m.Abort(7, "client cancelled"),
    m.Ping(3),
    m.Pong(3),
    m.Cancel(7),
    m.Register(
        8,
        "127.0.0.1:1234",
        [m.EntrySpec("target", {"attn": "mla"}, [5], 1 << 40, 16)],
        9,
        staging_addr=1 << 41,
        staging_slots=12,
        staging_slot_bytes=8 << 20,
    ),
    m.Want(7, 3),
    m.Grant(7, 11),
    m.Staged(7, 11, "draft", 0, 2, 4096, 1365),
    m.FirstToken(7, 42),
    m.Register(  # protocol 5: decode's deployment fingerprint
        9,
        "127.0.0.1:1234",
        [m.EntrySpec("target", {"attn": "gqa"}, [1], 1 << 40, 16)],
        4,
        fingerprint=Fingerprint(
            5, "0123456789abcdef", "a" * 32, "smollm2", "self:24", "f32/page16"
        ),
    ),
    m.Complete(7, 42, checksums={"target": [1, 2**32 - 1], "draft": [0]}),
    m.Refuse(7, "incompatible deployment: secret differs", "0123456789abcdef", 5),
]


def test_refuse_and_register_readable_across_versions():
    """A Refuse (unsigned, any envelope version) and a Register's room (without its MAC) are
    readable by peers of another protocol version; nothing else is."""
    enc = msgspec.msgpack.Encoder()
    refuse = m.Refuse(3, "incompatible deployment: protocol 6 vs 5 (prefill vs decode)", "", 6)
    future = enc.encode(m.Envelope(m.PROTOCOL_VERSION + 1, 0.0, enc.encode(refuse), None))
    assert m.peek_refusal(future) == refuse
    reg = enc.encode(m.Envelope(m.PROTOCOL_VERSION + 1, 0.0, enc.encode(SAMPLES[0]), b"mac"))
    assert m.peek_register(reg) == (m.PROTOCOL_VERSION + 1, SAMPLES[0].room)
    assert m.peek_refusal(reg) is None and m.peek_register(future) is None
    assert m.peek_refusal(b"garbage") is None and m.peek_register(b"") is None


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda x: type(x).__name__)
@pytest.mark.parametrize("secret", [None, SECRET])
def test_round_trip(msg, secret):
    assert m.decode(m.encode(msg, secret), secret) == msg


def test_random_garbage_never_raises_anything_but_message_error():
    rng = random.Random(0)
    frames = [bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 200))) for _ in range(500)]
    frames += [b"", b"\x00", b"\xc1", b"\x93\x01\x02\x03", b"\x80", b"\xa3abc"]
    for f in frames:
        with pytest.raises(m.MessageError):
            m.decode(f, SECRET)


@pytest.mark.parametrize("secret", [None, SECRET])
def test_every_truncation_is_rejected(secret):
    frame = m.encode(SAMPLES[0], secret)
    for n in range(len(frame)):
        with pytest.raises(m.MessageError):
            m.decode(frame[:n], secret)


def test_unknown_version():
    enc = msgspec.msgpack.Encoder()
    payload = enc.encode(m.Ping(1))
    frame = enc.encode(m.Envelope(m.PROTOCOL_VERSION + 1, 0.0, payload, None))
    with pytest.raises(m.MessageError) as e:
        m.decode(frame)
    assert e.value.kind == "version"


def test_hmac_required_and_checked():
    msg = m.Abort(1, "x")
    with pytest.raises(m.MessageError) as e:
        m.decode(m.encode(msg), SECRET)  # unsigned
    assert e.value.kind == "auth"
    with pytest.raises(m.MessageError) as e:
        m.decode(m.encode(msg, b"t" * 32), SECRET)  # other key
    assert e.value.kind == "auth"
    # payload swapped under a valid envelope MAC
    enc = msgspec.msgpack.Encoder()
    good = m.encode(msg, SECRET)
    env = msgspec.msgpack.decode(good, type=m.Envelope)
    evil = enc.encode(m.Envelope(env.v, env.t, enc.encode(m.Abort(2, "x")), env.mac))
    with pytest.raises(m.MessageError):
        m.decode(evil, SECRET)
    # the MAC covers the version and the send time too: neither can be moved
    for v, t in ((env.v + 1, env.t), (env.v, env.t + 1.0)):
        with pytest.raises(m.MessageError):
            m.decode(enc.encode(m.Envelope(v, t, env.p, env.mac)), SECRET)
    head = struct.pack(">Hd", env.v, env.t)
    mac = hmac.new(SECRET, head + env.p, hashlib.sha256).digest()
    assert m.decode(enc.encode(m.Envelope(env.v, env.t, env.p, mac)), SECRET) == msg


def test_verifier_drops_stale_and_replayed_frames():
    v = m.Verifier(SECRET, max_age_s=30)
    now = time.time()
    fresh = m.encode(m.Abort(1, "x"), SECRET, now=now)
    assert v.decode(fresh, now=now) == m.Abort(1, "x")
    with pytest.raises(m.MessageError) as e:
        v.decode(fresh, now=now + 1)  # the same frame again: a replay
    assert e.value.kind == "replay"
    old = m.encode(m.Abort(2, "x"), SECRET, now=now - 31)
    with pytest.raises(m.MessageError) as e:
        v.decode(old, now=now)
    assert e.value.kind == "stale"
    future = m.encode(m.Abort(3, "x"), SECRET, now=now + 31)
    with pytest.raises(m.MessageError) as e:
        v.decode(future, now=now)
    assert e.value.kind == "stale"
    # two legitimate messages with equal payloads differ by their send time
    a, b = (m.encode(m.Ping(5), SECRET, now=now + d) for d in (0.001, 0.002))
    assert v.decode(a, now=now) == v.decode(b, now=now) == m.Ping(5)
    assert m.Verifier(None).decode(m.encode(m.Ping(1)), now=now + 1e6) == m.Ping(1)  # no secret


def test_wrong_field_types_and_unknown_tags_are_garbage():
    enc = msgspec.msgpack.Encoder()
    for payload in (
        {"type": "ack", "room": "seven"},
        {"type": "nope", "room": 1},
        [1, 2],
        {"type": "complete", "room": 1, "first_token": 2, "extra": {"k": {"x": 1}}},
    ):
        frame = enc.encode(m.Envelope(m.PROTOCOL_VERSION, 0.0, enc.encode(payload), None))
        with pytest.raises(m.MessageError) as e:
            m.decode(frame)
        assert e.value.kind == "garbage"


def test_no_pickle_in_kvtransfer_sources():
    root = pathlib.Path(__file__).resolve().parents[2] / "kvtransfer"
    sources = list(root.rglob("*.py"))
    assert len(sources) >= 8
    pat = re.compile(r"pickle|recv_pyobj|send_pyobj")
    bad = [
        f"{p.name}:{i}"
        for p in sources
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pat.search(line)
    ]
    assert bad == []


def test_package_imports_without_torch_triton_or_mooncake():
    import subprocess
    import sys

    code = (
        "import sys, kvtransfer, kvtransfer.sender.sender, kvtransfer.receiver.receiver;"
        "bad = [m for m in ('torch', 'triton', 'tritonclient', 'mooncake') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
