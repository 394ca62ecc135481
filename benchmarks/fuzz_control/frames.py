"""Frames for the control-plane fuzzer (:mod:`benchmarks.fuzz_control.run`): each call returns
one frame for a target ("prefill", "decode" or "cancel"), drawn from these kinds:

* garbage: random bytes of random length, empty frames;
* broken: a valid frame truncated, bit-flipped or with bytes appended;
* unsigned / wrong key: a valid message without the secret's MAC, or with another key's;
* stale: a validly signed message sent as if captured minutes ago;
* hostile: validly signed and well formed, but wrong: registrations with pages outside the
  pool, negative or repeated, wrong counts, foreign sessions and addresses, wrong layouts,
  huge token counts; Acks with the wrong layout; Completes and Fails for rooms the sender
  does not own; messages of the wrong direction; random rooms.
"""

from __future__ import annotations

import random
import time

from kvtransfer import EntryLayout
from kvtransfer import messages as m
from tests.helpers.kvpeer import LAYOUTS

KINDS = ("garbage", "broken", "unsigned", "wrong_key", "stale", "hostile")
WEIGHTS = (15, 15, 10, 10, 10, 40)


class Mutator:
    def __init__(self, rng: random.Random, secret: bytes, victim_session: str, victim_base: int):
        self.rng, self.secret = rng, secret
        self.victim_session, self.victim_base = victim_session, victim_base
        lay = EntryLayout(role="target", page_size=16, num_pages=128, **LAYOUTS["gqa"])
        self.signature = lay.signature()
        self.counts = dict.fromkeys(KINDS, 0)

    def frame(self, target: str, victim_rooms: list[int]) -> tuple[bytes, bool]:
        """One frame for ``target``, and whether a receiver must drop it as invalid: every frame
        of the kinds that are never valid, and a hostile frame whose message breaks the schema
        (a negative count)."""
        kind = self.rng.choices(KINDS, WEIGHTS)[0]
        self.counts[kind] += 1
        frame = self._make(kind, target, victim_rooms)
        if kind != "hostile":
            return frame, True
        try:
            m.decode(frame, self.secret)
        except m.MessageError:
            return frame, True
        return frame, False

    def _make(self, kind: str, target: str, victim_rooms: list[int]) -> bytes:
        r = self.rng
        if kind == "garbage":
            return r.randbytes(r.choice([0, 1, 7, 64, 300, 5000]))
        msg = self.message(target, victim_rooms)
        if kind == "unsigned":
            return m.encode(msg)
        if kind == "wrong_key":
            return m.encode(msg, r.randbytes(32))
        if kind == "stale":
            return m.encode(msg, self.secret, now=time.time() - r.uniform(200, 10_000))
        frame = m.encode(msg, self.secret)
        return self._break(frame) if kind == "broken" else frame

    def _break(self, frame: bytes) -> bytes:
        r, b = self.rng, bytearray(frame)
        how = r.randrange(3)
        if how == 0:
            return bytes(b[: r.randrange(len(b))])
        if how == 1:  # distinct bits, so two flips never cancel out
            bits = r.sample(range(8 * len(b)), min(r.randint(1, 4), 8 * len(b)))
            for bit in bits:
                b[bit // 8] ^= 1 << (bit % 8)
            return bytes(b)
        return bytes(b) + r.randbytes(r.randint(1, 50))

    def message(self, target: str, victim_rooms: list[int]) -> m.Message:
        r = self.rng
        room = r.choice([*victim_rooms, r.randrange(1, 2**63), r.randrange(1, 100)])
        makers = {
            "prefill": [self._register, self._register, lambda x: m.Abort(x, "fuzz"), self._other],
            "decode": [self._ack, self._complete, lambda x: m.Fail(x, "fuzz"), self._other],
            "cancel": [lambda x: m.Cancel(x), lambda x: m.Cancel(-x), self._other],
        }[target]
        return r.choice(makers)(room)

    def _pages(self) -> list[int]:
        r = self.rng
        n = r.choice([0, 1, 5, 6, 7, 64, 3000])
        pool = r.choice([128, 2**31, 2**62])
        pages = [r.randrange(-5, pool) for _ in range(n)]
        if pages and r.random() < 0.2:
            pages[-1] = pages[0]  # a repeat
        return pages

    def _register(self, room: int) -> m.Register:
        r = self.rng
        sig = dict(self.signature)
        if r.random() < 0.3:
            sig[r.choice(list(sig))] = r.choice([0, -1, 3, "bfloat16", "mla", 10**12])
        session = r.choice([self.victim_session, "127.0.0.1:1", "10.9.8.7:15000", "x", ""])
        base = r.choice([self.victim_base, 0, -4096, 2**63 - 1, r.randrange(1, 2**47)])
        num_pages = r.choice([128, 0, -1, 2**40])
        entry = m.EntrySpec(r.choice(["target", "draft", "x"]), sig, self._pages(), base, num_pages)
        tokens = r.choice([90, 0, -3, 2**40, r.randrange(1, 5000)])
        proof = r.choice([b"", r.randbytes(32), r.randbytes(5)])
        return m.Register(room, session, [entry] * r.choice([1, 1, 2]), tokens, base, proof)

    def _ack(self, room: int) -> m.Ack:
        sig = dict(self.signature)
        if self.rng.random() < 0.5:
            sig["head_dim"] = self.rng.choice([0, 17, 10**9])
        return m.Ack(room, self.rng.choice([{"target": sig}, {}, {"draft": sig}]))

    def _complete(self, room: int) -> m.Complete:
        r = self.rng
        extra = r.choice([{}, {"k": 1}, {"x": [1, 2.5, "y"]}, {"big": "z" * 2000}])
        return m.Complete(room, r.choice([0, -1, 2**40, r.randrange(1000)]), extra)

    def _other(self, room: int) -> m.Message:
        r = self.rng
        return r.choice(
            [m.Ping(r.randrange(2**31)), m.Pong(r.randrange(2**31)), m.Cancel(room),
             m.Ack(room, {}), m.Complete(room, 1), m.Fail(room, "x" * r.randrange(5000))]
        )  # fmt: skip
