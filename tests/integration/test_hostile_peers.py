"""Hostile peers against a real prefill (own process, real Mooncake, HMAC on). The attacker has
the shared secret and a Mooncake session of its own, so only the deeper checks can stop it.
In each test a legitimate room still succeeds byte for byte and no byte lands outside a claimed
page: the legitimate decode's other pages and the attacker's pool stay zero."""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq
from kvpeer import LAYOUTS

from kvtransfer import EntryLayout, KVReceiver, TransferConfig
from kvtransfer import messages as m

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SECRET = b"hostile-test-secret-0123456789"
ENTRIES = {"target": ("gqa", 16, 64)}
TOKENS = 90  # 6 pages of 16


class Attacker:
    """A Mooncake session of its own (a real KVReceiver with a zero pool) and raw control
    connections to prefill, on which it sends whatever it likes, signed."""

    def __init__(self, prefill_addr: str):
        lay = EntryLayout(role="target", page_size=16, num_pages=64, **LAYOUTS["gqa"])
        self.buf = np.zeros(lay.nbytes, np.uint8)
        self.layout = lay.with_pool(64, self.buf.ctypes.data)
        cfg = TransferConfig(shared_secret=SECRET, bootstrap_timeout_s=20.0)
        self.rx = KVReceiver(cfg, {"target": self.layout})
        self.ctx = zmq.Context()
        self.addr = prefill_addr

    def connect(self) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://{self.addr}")
        return s

    def register(self, room: int, pages: list[int], session: str | None = None, base: int = 0):
        lay = self.layout
        entry = m.EntrySpec("target", lay.signature(), pages, base or lay.base_addr, lay.num_pages)
        return m.Register(
            room,
            session or self.rx.session_id,
            [entry],
            TOKENS,
            self.rx.token.addr,
            self.rx.token.token,
        )

    def answers(self, sock: zmq.Socket, timeout: float = 10.0) -> list[m.Message]:
        out, end = [], time.time() + timeout
        while time.time() < end and sock.poll(200):
            frame = sock.recv()
            try:
                out.append(m.decode(frame, SECRET))
            except m.MessageError:  # only prefill's unsigned Refuse hint is ever unsigned
                hint = m.peek_refusal(frame)
                assert hint is not None, frame
                out.append(hint)
        return out

    def close(self) -> None:
        self.ctx.destroy(linger=0)
        self.rx.close()


@pytest.fixture
def pair(spawn):
    prefill = spawn("prefill", ENTRIES, shared_secret=SECRET)
    decode = spawn("decode", ENTRIES, shared_secret=SECRET)
    attacker = Attacker(prefill.info["bootstrap_addr"])
    yield prefill, decode, attacker
    attacker.close()


def legit_room(prefill, decode, room: int) -> None:
    prefill.alloc_pages(room, {"target": 6})
    decode.alloc_pages(room, {"target": 8})
    decode.register(room, [prefill.info["bootstrap_addr"]], TOKENS)
    prefill.start_room(room)
    prefill.run_prefill(room, [("target", 0, 2), ("target", 2, 4)], 0.0, 0.0, 5, None)
    assert tuple(decode.wait(room, 60)) == ("Success", "")
    assert decode.digest(room, "target", 6) == prefill.digest(room, "target", 6)


def prefill_room(prefill, room: int) -> None:
    """prefill computes ``room`` (its KV goes to whoever registers it)."""
    prefill.alloc_pages(room, {"target": 6})
    prefill.start_room(room)
    prefill.run_prefill(room, [("target", 0, 4)], 0.0, 0.0, 9, None)


@pytest.mark.parametrize(
    "pages",
    [[-1, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 64], [0, 1, 2, 3, 4, 1 << 40], [0, 0, 1, 2, 3, 4]],
)
def test_bad_page_ids_fail_that_room_only(pair, pages):
    prefill, decode, attacker = pair
    prefill_room(prefill, 50)
    s = attacker.connect()
    s.send(m.encode(attacker.register(50, pages), SECRET))
    fails = [a for a in attacker.answers(s) if isinstance(a, m.Fail)]
    assert fails and ("outside" in fails[0].reason or "repeated" in fails[0].reason), fails
    assert prefill.wait(50, 30)[0] == "Failed"
    legit_room(prefill, decode, 1)
    assert decode.untouched([1]) and not attacker.buf.any()


def test_too_few_or_too_many_pages_are_refused(pair):
    prefill, decode, attacker = pair
    s = attacker.connect()
    for n in (5, 7):  # the prompt needs exactly 6 pages of 16 for 90 tokens
        prefill_room(prefill, 60 + n)
        s.send(m.encode(attacker.register(60 + n, list(range(n))), SECRET))
    reasons = [a.reason for a in attacker.answers(s) if isinstance(a, m.Fail)]
    assert len(reasons) == 2 and all("need 6" in r for r in reasons), reasons
    legit_room(prefill, decode, 1)
    assert decode.untouched([1]) and not attacker.buf.any()


def test_a_foreign_session_is_refused_and_not_stolen(pair):
    """The attacker names the legitimate decode's session and pool (before that decode ever
    registered): it cannot prove it owns the session, and the owner keeps it."""
    prefill, decode, attacker = pair
    victim_session = decode.call("session_id")
    victim_base = decode.call("base_addr", "target")
    prefill_room(prefill, 70)
    s = attacker.connect()
    s.send(m.encode(attacker.register(70, list(range(6)), victim_session, victim_base), SECRET))
    fails = [a for a in attacker.answers(s) if isinstance(a, m.Fail)]
    # its token address is not in the victim's memory, or the victim's token is not its own
    assert fails and "registration refused" in fails[0].reason, fails
    assert "session" in fails[0].reason, fails
    legit_room(prefill, decode, 1)  # the owner's registrations still work
    assert decode.untouched([1]) and not attacker.buf.any()
    assert prefill.dropped().get("hostile", 0) >= 1


def test_five_thousand_registrations_are_capped(pair):
    prefill, decode, attacker = pair
    s = attacker.connect()
    s.send(m.encode(attacker.register(10**6, list(range(6))), SECRET))  # proves the session
    time.sleep(1.0)
    for room in range(5000):
        s.send(m.encode(attacker.register(2 * 10**6 + room, list(range(6))), SECRET))
    deadline = time.time() + 30
    while prefill.stats()["pending_registrations"] < 256 and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)
    st = prefill.stats()
    assert st["pending_registrations"] <= 256 + 1  # the per-connection cap (+ the first)
    assert prefill.dropped().get("flood", 0) >= 4000
    legit_room(prefill, decode, 1)
    assert decode.untouched([1]) and not attacker.buf.any()


def test_an_oversized_frame_is_dropped_and_prefill_serves_on(pair):
    prefill, decode, attacker = pair
    s = attacker.connect()
    s.send(b"\x00" * (8 << 20))  # far over the largest Register this prefill can be sent:
    time.sleep(1.0)  # zmq (MAXMSGSIZE) drops it with its connection, never buffers it whole
    legit_room(prefill, decode, 1)
    s2 = attacker.connect()
    s2.send(m.encode(m.Ping(8), SECRET))
    assert m.decode(s2.recv() if s2.poll(5000) else b"", SECRET) == m.Pong(8)


def test_replayed_and_unsigned_messages_are_dropped(pair):
    prefill, decode, attacker = pair
    prefill_room(prefill, 80)
    s = attacker.connect()
    now = time.time()
    frames = [
        m.encode(attacker.register(80, list(range(6)))),  # unsigned
        m.encode(attacker.register(80, list(range(6))), b"x" * 32),  # another key
        m.encode(attacker.register(80, list(range(6))), SECRET, now=now - 600),  # a stale capture
    ]
    fresh = m.encode(m.Ping(3), SECRET)
    for f in [*frames, fresh, fresh]:  # the same signed frame twice: a replay
        s.send(f)
    answers = attacker.answers(s, 3)
    # the two Registers it cannot verify get an unsigned Refuse (a hint that changes nothing
    # at prefill: room 80 stays unclaimed); only the first copy of the fresh ping is answered
    refused = [a for a in answers if isinstance(a, m.Refuse)]
    assert [a for a in answers if a not in refused] == [m.Pong(3)]
    assert len(refused) == 2 and all(a.room == 80 and "secret differs" in a.reason for a in refused)
    dropped = prefill.dropped()
    assert dropped.get("auth", 0) >= 2 and dropped.get("stale", 0) >= 1
    assert dropped.get("replay", 0) >= 1
    assert prefill.status(80) not in ("Transferring", "Success")  # room 80 was never claimed
    legit_room(prefill, decode, 1)
    assert decode.untouched([1]) and not attacker.buf.any()


def test_aborts_from_a_peer_that_does_not_own_the_room_change_nothing(pair):
    """Another authenticated peer aborts a legitimate room by id while decode's registration
    waits for prefill, and again after prefill claimed it. Each time it only hears "room not
    active", and the owner's room still arrives byte for byte."""
    prefill, decode, attacker = pair
    s = attacker.connect()
    legit_room(prefill, decode, 1)
    prefill.alloc_pages(2, {"target": 6})
    decode.alloc_pages(2, {"target": 8})
    decode.register(2, [prefill.info["bootstrap_addr"]], TOKENS)
    time.sleep(0.5)  # decode's registration of room 2 is pending at prefill
    s.send(m.encode(m.Abort(2, "hostile"), SECRET))
    prefill.start_room(2)  # prefill claims decode's registration
    time.sleep(0.5)
    s.send(m.encode(m.Abort(2, "hostile"), SECRET))
    replies = attacker.answers(s, 2)
    assert [type(a) for a in replies] == [m.Fail, m.Fail], replies
    assert all("not active" in a.reason for a in replies), replies
    prefill.run_prefill(2, [("target", 0, 2), ("target", 2, 4)], 0.0, 0.0, 5, None)
    assert tuple(decode.wait(2, 60)) == ("Success", "")
    assert decode.digest(2, "target", 6) == prefill.digest(2, "target", 6)
    assert decode.untouched([1, 2]) and not attacker.buf.any()


def test_a_room_aborted_before_anyone_registered_fails_its_decode_at_once(pair):
    """An Abort for a room nobody registered yet ends it (a decode that refuses a request
    before registering says so this way), so a later registration of that room can only fail;
    its decode hears so at once, not after the 20 s bootstrap timeout."""
    prefill, decode, attacker = pair
    s = attacker.connect()
    s.send(m.encode(m.Abort(3, "hostile"), SECRET))
    assert [type(a) for a in attacker.answers(s, 2)] == [m.Fail]  # "room not active"
    prefill.alloc_pages(3, {"target": 6})
    decode.alloc_pages(3, {"target": 8})
    decode.register(3, [prefill.info["bootstrap_addr"]], TOKENS)
    status, reason = decode.wait(3, 5)
    assert status == "Failed" and "aborted by decode: hostile" in reason, (status, reason)
    prefill.start_room(3)  # the stage's request for the room fails, its pages come back
    status, reason = prefill.wait(3, 5)
    assert status == "Failed" and "aborted by decode: hostile" in reason, (status, reason)
    legit_room(prefill, decode, 4)
    assert decode.untouched([4]) and not attacker.buf.any()
