"""Latency and size observations for the stages' Prometheus histograms
(:data:`.metrics.HISTOGRAMS`).

Triton 2.51's Python backend has histogram metrics (``pb.MetricFamily.HISTOGRAM``: a metric is
created with its ``buckets`` and fed with ``observe(value)``), but a metric may only be touched
through ``pb``, i.e. from the Triton glue. So the stage cores only record: each observation goes
into a bounded per-key buffer (:class:`Observations`, no Triton import), and the glue's metrics
thread drains it into the histograms every 0.25 s. A buffer that overflows between two drains
(more than ``MAX_PENDING`` observations of one key in 0.25 s) drops the oldest and counts them.

Keys (seconds unless said): ``ttft`` (decode submit -> first token), ``itl`` (between two tokens
of a request), ``e2e`` (decode submit -> final response), ``queue`` (decode: submit -> pages
registered with prefill; prefill: queued -> compute start), ``kv_transfer`` (per request; prefill:
first group queued -> last landed; decode: claim -> Complete), ``kv_bytes`` (per request).
"""

from __future__ import annotations

import threading
from collections import deque

MAX_PENDING = 65536


class Observations:
    def __init__(self):
        self._lock = threading.Lock()
        self._pending: dict[str, deque] = {}
        self.dropped = 0

    def observe(self, key: str, value: float) -> None:
        with self._lock:
            q = self._pending.get(key)
            if q is None:
                q = self._pending[key] = deque(maxlen=MAX_PENDING)
            if len(q) == MAX_PENDING:
                self.dropped += 1
            q.append(float(value))

    def drain(self) -> dict[str, list[float]]:
        with self._lock:
            out = {k: list(q) for k, q in self._pending.items() if q}
            for q in self._pending.values():
                q.clear()
        return out

    def request_done(self, t: dict[str, float]) -> None:
        """A decode request ended; ``t``: its timestamps (time.time(); decode/state.py)."""
        sub = t.get("submitted")
        if sub is None:
            return
        for key, mark in (("ttft", "first_token"), ("e2e", "finished"), ("queue", "registered")):
            if mark in t:
                self.observe(key, t[mark] - sub)

    def room_done(self, nbytes: int, seconds: float) -> None:
        """A room's KV transfer succeeded (kvtransfer TransferStats observer)."""
        self.observe("kv_transfer", seconds)
        self.observe("kv_bytes", nbytes)
