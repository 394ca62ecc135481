"""Ending a decode request before it finishes: client cancels in every phase, and queue expiry.
Loop thread, except :meth:`RequestControl.cancel` (any thread: the cancel channel, the serving
layer).

Cancel, by phase (each ends the request with one final event at once):

* waiting for pages: leaves the queue; prefill is told the room will never be registered;
* transferring: decode aborts the room; its pages stay quarantined until prefill confirms its
  writes drained (or is proven gone), then are freed;
* running: the engine aborts the sequence and frees its pages (within one step).

A request that waited past ``queue_timeout_s`` for pages ends ``overloaded`` (nothing was computed
for it: prefill computes a room only once decode registered its pages).
"""

from __future__ import annotations

import logging
import time

from kvtransfer import KVReceiver

from ...runtime.engine import LLMEngine
from .. import errors
from ..request import StageRequest
from .events import Responder
from .state import ActiveRequest, Phase, Requests, always

log = logging.getLogger(__name__)

CANCEL_POLL_S = 0.05  # how often the loop asks every request's is_cancelled() with no cancel named


class RequestControl:
    """Owns the cancels named but not yet applied. ``requests``: the worker's table; ``out``: its
    events; ``receiver`` aborts and refuses rooms at prefill; ``engine`` aborts running sequences;
    ``counters``: the worker's (``overloaded``)."""

    def __init__(
        self,
        requests: Requests,
        out: Responder,
        receiver: KVReceiver,
        engine: LLMEngine,
        counters: dict,
        queue_timeout_s: float,
        name: str,
    ):
        self.requests, self.out, self.receiver, self.engine = requests, out, receiver, engine
        self.counters, self.queue_timeout_s, self.name = counters, queue_timeout_s, name
        self._rooms: set[int] = set()  # rooms named by a cancel (under requests.cond)
        self._last_poll = 0.0

    def cancel(self, room: int) -> None:
        """Stop the request of ``room`` (its current room or the one the client knows)."""
        with self.requests.cond:
            self._rooms.add(room)
            self.requests.cond.notify_all()

    @property
    def pending(self) -> bool:
        """Holds ``requests.cond``: a cancel was named since the last :meth:`poll`."""
        return bool(self._rooms)

    def poll(self) -> None:
        """Apply the cancels named since the last poll, and (every CANCEL_POLL_S) each request's
        own ``is_cancelled()``."""
        now = time.monotonic()
        with self.requests.cond:
            rooms, self._rooms = self._rooms, set()
        if not rooms and now - self._last_poll < CANCEL_POLL_S:
            return
        self._last_poll = now
        for r in self.requests.all():
            if r.req.room in rooms or r.client_room in rooms:
                r.is_cancelled = always
            if r.phase != Phase.DONE and r.cancel_requested():
                r.cancelled = True
                self.cancel_one(r)

    def cancel_one(self, r: ActiveRequest) -> None:
        if r.phase == Phase.WAITING:
            with self.requests.cond:
                if r in self.requests.waiting:
                    self.requests.waiting.remove(r)
            self.refuse(r.req, "client cancelled")
        elif r.phase == Phase.TRANSFER:  # pages stay with the room until it is released
            self.receiver.abort(r.req.room, "client cancelled")
        elif r.phase == Phase.RUNNING and r.seq_id in self.requests.running:
            self.engine.abort(r.seq_id)
            del self.requests.running[r.seq_id]
        self.out.finish(r)

    def refuse(self, req: StageRequest, reason: str) -> None:
        """Tell prefill at once that this room will never be registered, so it drops the
        request now instead of after its queue timeout (best effort)."""
        if req.bootstrap_addr:
            try:
                self.receiver.refuse(req.room, [req.bootstrap_addr], reason)
            except Exception:
                log.debug("%s: room %d: refusing at prefill failed", self.name, req.room)

    def expire_waiting(self) -> None:
        """End every request that waited past queue_timeout_s for pages ``overloaded``."""
        limit = self.queue_timeout_s
        now = time.monotonic()
        with self.requests.cond:
            old = [r for r in self.requests.waiting if now - r.queued_at > limit]
            for r in old:
                self.requests.waiting.remove(r)
        for r in old:
            self.counters["overloaded"] += 1
            msg = f"overloaded, retry later: waited {limit:g}s for KV pages"
            self.refuse(r.req, msg)
            self.out.finish(r, error=msg, kind=errors.OVERLOADED)
