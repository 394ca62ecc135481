"""A decode server's side of routing (a mixin of :class:`~.decode.DecodeWorker`): local
prefill and failover.

Local prefill (conditional disaggregation): a request the router marked ``LOCAL`` (short
prompt, or every prefill server busy) goes straight into this worker's engine, which prefills
it in its own pool: no pages registered, no KV transfer (:meth:`_take_local`).

Failover (``prefill_servers`` set): when a room fails before its KV completed (the prefill
server died, hung or refused), the request is re-dispatched to another prefill server under a
fresh room, and the client never sees the failure.

* The failed room keeps its pages: the receiver holds them in quarantine until the old prefill
  confirms its writes drained or is proven gone (write fence unchanged), then the decode loop
  frees them through the room's release, as for any failed room.
* The request gets new destination pages (FIFO front: it waited already) and registers them
  under the fresh room with the prefill server the router picks (never the one that failed it,
  when another is up). A client cancel still names the request's first room (``client_room``).
* After ``failover_attempts`` re-dispatches, or when no prefill server takes it, the request
  ends with an error naming every cause.

Re-dispatch waits for a prefill server's answer (at most ``route_timeout_s`` per server tried),
so it runs on a small thread pool, never on the decode loop thread; its result is taken by the
loop (:meth:`_take_rerouted`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import msgspec

from .decode_state import ActiveRequest, Phase
from .params import StageParams
from .request import new_room
from .router import LOCAL, PrefillRouter

__all__ = ["LOCAL", "DecodeFailover"]

log = logging.getLogger(__name__)

NOT_RETRIED = ("aborted by decode",)  # decode gave the room up itself (client cancel, shutdown)


class DecodeFailover:
    def _init_failover(self, params: StageParams) -> None:
        self.router: PrefillRouter | None = None
        self.counters.setdefault("local_prefills", 0)
        if params.prefill_servers:
            self.router = PrefillRouter(
                params.servers(), params.route_timeout_s, params.probe_interval_s,
                name=f"{self.name}-failover", fingerprint=self.receiver.fingerprint,
            )  # fmt: skip
        self._rerouted: deque[tuple[ActiveRequest, str | None]] = deque()
        self._local: deque[ActiveRequest] = deque()  # to prefill in this engine
        self._reroute_lock = threading.Lock()
        self._reroute_pool = ThreadPoolExecutor(4, thread_name_prefix=f"{self.name}-reroute")
        self.counters.setdefault("failovers", 0)

    def _retry(self, r: ActiveRequest, reason: str) -> bool:
        """Re-dispatch ``r`` (whose room failed with ``reason`` before completing) under a fresh
        room; False when it is not to be retried (then the caller ends it with the error)."""
        if self.router is None or r.cancelled or r.cancel_requested() or self._stop:
            return False
        if r.attempts >= self.params.failover_attempts or reason.startswith(NOT_RETRIED):
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
            self.name, r.req.room, reason, req.room,
        )  # fmt: skip
        self._reroute_pool.submit(self._redispatch, nxt, reason)
        return True

    def _redispatch(self, nxt: ActiveRequest, why: str) -> None:  # pool thread
        err = None
        try:
            nxt.req, _server = self.router.dispatch(nxt.req)
        except Exception as e:
            err = f"KV transfer failed ({why}); re-dispatching it failed too: {e}"
        with self._cond:
            self._rerouted.append((nxt, err))
            self._cond.notify_all()

    def _take_rerouted(self) -> None:  # loop thread
        while True:
            with self._cond:
                if not self._rerouted:
                    return
                nxt, err = self._rerouted.popleft()
                if err is None and not nxt.cancel_requested():
                    nxt.queued_at = time.monotonic()
                    self._waiting.appendleft(nxt)  # it waited already: first in line
                    continue
            if err is None:  # cancelled meanwhile: nothing registered yet
                nxt.cancelled = True
                self._refuse(nxt.req, "client cancelled")
            self._finish(nxt, error=err)

    def _take_local(self) -> None:  # loop thread
        while True:
            with self._cond:
                if not self._local:
                    return
                r = self._local.popleft()
            try:
                seq = self.engine.add_request(r.seq_id, r.req.prompt_ids, r.req.sampling)
                r.text = seq.text  # the engine's detokenizer (a fresh one: nothing streamed yet)
            except Exception as e:  # this request only
                self._finish(r, error=f"decode could not take the request: {e}")
                continue
            r.t["local_prefill"] = time.time()
            self.counters["local_prefills"] = self.counters.get("local_prefills", 0) + 1
            r.phase = Phase.RUNNING
            self._running[r.seq_id] = r

    def _close_failover(self) -> None:
        self._reroute_pool.shutdown(wait=False, cancel_futures=True)
        if self.router is not None:
            self.router.close()

    def failover_stats(self) -> dict:
        return {} if self.router is None else {"router": self.router.stats()}
