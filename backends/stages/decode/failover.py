"""A decode server's failover (``prefill_servers`` set): when a room fails before its KV completed
(the prefill server died, hung or refused), the request is re-dispatched to another prefill server
under a fresh room, and the client never sees the failure.

* The failed room keeps its pages: the receiver holds them in quarantine until the old prefill
  confirms its writes drained or is proven gone (write fence unchanged), then the decode loop
  frees them through the room's release, as for any failed room.
* The request gets new destination pages (FIFO front: it waited already) and registers them
  under the fresh room with the prefill server the router picks (never the one that failed it,
  when another is up). A client cancel still names the request's first room (``client_room``).
* After ``failover_attempts`` re-dispatches, or when no prefill server takes it, the request
  ends with an error naming every cause.

Re-dispatch waits for a prefill server's answer (at most ``route_timeout_s`` per server tried),
so it runs on a small thread pool, never on the decode loop thread; its result goes to
``on_rerouted``, which hands it to the loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor

import msgspec

from ..request import new_room
from ..router import PrefillRouter
from .state import ActiveRequest, Phase

__all__ = ["Failover"]

log = logging.getLogger(__name__)

# (the request under its fresh room, None) once a prefill server took it, else (it, the error)
OnRerouted = Callable[[ActiveRequest, str | None], None]


class Failover:
    """Owns the re-dispatches of one decode worker and their count (``counters``).

    ``router`` picks the prefill server (None: failover off, nothing is retried); ``attempts``:
    re-dispatches per request at most; ``stopping()``: the worker is closing (nothing retried);
    ``executor`` runs the re-dispatches (default: 4 threads of their own).
    """

    def __init__(
        self,
        router: PrefillRouter | None,
        attempts: int,
        on_rerouted: OnRerouted,
        stopping: Callable[[], bool],
        name: str = "decode",
        executor: Executor | None = None,
    ):
        self.router, self.attempts, self.name = router, attempts, name
        self.on_rerouted, self.stopping = on_rerouted, stopping
        self.counters = {"failovers": 0}
        self._pool = executor or ThreadPoolExecutor(4, thread_name_prefix=f"{name}-reroute")

    def retry(self, r: ActiveRequest, reason: str) -> bool:
        """Re-dispatch ``r`` (whose room failed with ``reason`` before completing) under a fresh
        room; False when it is not to be retried (then the caller ends it with the error).

        Decided by the request's state, never by the reason's words: decode gives a room up
        itself only for a request that already ended (client cancel or gone: cancelled, or
        ``Phase.DONE``) or while the worker stops, so its own abort is never re-dispatched."""
        if self.router is None or r.cancelled or r.cancel_requested() or self.stopping():
            return False
        if r.phase != Phase.TRANSFER or r.attempts >= self.attempts:
            return False
        sampling = r.req.sampling
        if r.early_first is not None and not (sampling.greedy or sampling.seed is not None):
            return False  # another prefill could sample another first token than the streamed one
        r.phase = Phase.DONE  # this room's pages wait for its release (quarantine); no event
        req = msgspec.structs.replace(r.req, room=new_room(), bootstrap_addr="")
        nxt = ActiveRequest(req, r.emit, r.is_cancelled, origin=r.client_room)
        nxt.attempts, nxt.t, nxt.last_event = r.attempts + 1, dict(r.t), r.last_event
        # a first token already streamed stays the stream's first token: the new room's
        # FirstToken is not streamed again, and the engine's report of it is dropped once
        nxt.early_first, nxt.out_ids = r.early_first, list(r.out_ids)
        nxt.text = r.text  # the detokenizer (and stop strings) has seen exactly those tokens
        nxt.t["failover"] = time.time()
        self.counters["failovers"] += 1
        log.warning(
            "%s: room %d failed before completing (%s): re-dispatching as room %d",
            self.name,
            r.req.room,
            reason,
            req.room,
        )
        self._pool.submit(self._redispatch, nxt, reason)
        return True

    def _redispatch(self, nxt: ActiveRequest, why: str) -> None:  # pool thread
        err = None
        try:
            nxt.req, _server = self.router.dispatch(nxt.req)
        except Exception as e:
            err = f"KV transfer failed ({why}); re-dispatching it failed too: {e}"
        self.on_rerouted(nxt, err)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.router is not None:
            self.router.close()
