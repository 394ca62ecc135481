"""Fault injection for tests, soak runs and benchmarks; never set in production.

``KVTRANSFER_FAULTS="fail=0.05,delay=0.2,seed=3"`` in a sender's environment:

* ``fail``: the share of rooms whose KV writes fail (chosen from the room id and the seed, so
  every group of a chosen room fails and the choice is reproducible), after ``delay`` when
  one is set (a write that fails late, e.g. after the first token went to decode);
* ``flip`` (in a RECEIVER's environment): the share of rooms in which decode flips one bit of the
  landed KV (first page, layer 0) right before it verifies ``kv_checksum`` (a corrupted write);
* ``delay``: seconds every layer group waits (on the transfer worker, like a slow completion
  fence) before its writes go out, to hold rooms in the Transferring phase.

Unset, nothing changes. The sender logs the active setting once at start.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass

ENV = "KVTRANSFER_FAULTS"


@dataclass(frozen=True)
class Faults:
    fail: float = 0.0
    delay_s: float = 0.0
    flip: float = 0.0
    seed: int = 0

    @classmethod
    def from_env(cls, value: str | None = None) -> Faults:
        raw = os.environ.get(ENV, "") if value is None else value
        kw: dict = {}
        for item in filter(None, (x.strip() for x in raw.split(","))):
            key, _, v = item.partition("=")
            if key not in ("fail", "delay", "seed", "flip") or not v:
                raise ValueError(f"{ENV}: {item!r} is not fail=P, delay=S, flip=P or seed=N")
            kw["delay_s" if key == "delay" else key] = int(v) if key == "seed" else float(v)
        return cls(**kw)

    @property
    def active(self) -> bool:
        return self.fail > 0 or self.delay_s > 0 or self.flip > 0

    def fails(self, room: int) -> bool:
        """Whether this room's writes are to fail (deterministic per room and seed)."""
        return self._chosen(room, self.fail)

    def flips(self, room: int) -> bool:
        """Whether decode corrupts this room's landed KV (deterministic per room and seed)."""
        return self._chosen(room, self.flip)

    def _chosen(self, room: int, share: float) -> bool:
        if share <= 0:
            return False
        h = hashlib.sha256(f"{self.seed}:{room}".encode()).digest()
        return int.from_bytes(h[:8], "big") / 2**64 < share

    def delayed(self, fence):
        """``fence`` that also waits ``delay_s`` from now (None when no delay is set)."""
        return _Delayed(fence, time.monotonic() + self.delay_s) if self.delay_s > 0 else fence


class _Delayed:
    def __init__(self, inner, ready_at: float):
        self.inner, self.ready_at = inner, ready_at

    def query(self) -> bool:
        return time.monotonic() >= self.ready_at and (self.inner is None or self.inner.query())
