"""The decode worker's request control: final events, client cancels in every phase, heartbeats,
and queue expiry. A mixin of :class:`~.decode.DecodeWorker` (same thread rules: the methods
here run on the worker's loop thread).

Cancel, by phase (each ends the request with one final event at once):

* waiting for pages: leaves the queue; prefill is told the room will never be registered;
* transferring: decode aborts the room; its pages stay quarantined until prefill confirms its
  writes drained (or is proven gone), then are freed;
* running: the engine aborts the sequence and frees its pages (within one step).
"""

from __future__ import annotations

import logging
import time

from . import errors
from .decode_state import ActiveRequest, DecodeEvent, Phase, always

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.25  # a request with nothing to send gets an empty event this often
CANCEL_POLL_S = 0.05


class DecodeControl:
    def _all(self) -> list[ActiveRequest]:
        with self._cond:
            return [*self._waiting, *self._transfers.values(), *self._running.values()]

    def _send(self, r: ActiveRequest, ev: DecodeEvent) -> bool:
        r.last_event = time.monotonic()
        try:
            r.emit(ev)
            return True
        except Exception as e:  # the client is gone: stop generating for it
            log.info("%s: room %d: emit failed (%s); aborting", self.name, r.req.room, e)
            if r.phase != Phase.DONE:
                r.cancelled = True
                self._cancel_one(r)
            return False

    def _finish(self, r, error=None, reason=None, tokens=(), logprobs=(), kind=errors.INTERNAL):
        """The request's one final event (no-op when it already ended)."""
        if r.phase == Phase.DONE:
            return
        r.phase = Phase.DONE
        r.t["finished"] = time.time()
        self.latency.request_done(r.t)
        if error:
            self.counters["failed"] += 1
            ev = DecodeEvent(final=True, error=error, error_kind=kind)
        elif r.cancelled:
            self.counters["cancelled"] += 1
            ev = DecodeEvent(final=True, finish_reason="cancelled")
        elif r.req.stream:
            ev = self._event(r, tokens, logprobs, final=True, finish_reason=reason)
        else:
            ev = self._event(r, r.out_ids, r.out_logprobs, final=True, finish_reason=reason)
        self._send(r, ev)
        self.trace.write({"stage": "decode", "room": r.req.room, "error": error,
                          "cancelled": r.cancelled, **r.t, "tokens": len(r.out_ids)})  # fmt: skip

    def _event(self, r: ActiveRequest, tokens, logprobs, final=False, **kw) -> DecodeEvent:
        """An event with ``tokens`` and the text they add (the prompt's first, with echo)."""
        text = r.text.take(final) if r.text is not None else ""
        if r.req.echo and not r.echoed:
            r.echoed = True
            text = (self.tok.decode(r.req.prompt_ids) if self.tok else "") + text
        return DecodeEvent(list(tokens), text, list(logprobs), final=final, **kw)

    def _streams_early(self, r: ActiveRequest, token: int) -> bool:
        """Whether prefill's first token may go out before the KV landed: only when it cannot
        be the last one (a stream never ends with an empty extra event) and carries no
        logprobs (they come with the KV)."""
        sp = r.req.sampling
        if not r.req.stream or sp.max_tokens < 2 or sp.logprobs is not None:
            return False
        if token in sp.stop_token_ids or (token in self.eos_ids and not sp.ignore_eos):
            return False
        return r.text is None or not r.text.update([token])  # a stop string ends it here

    def _on_first(self, room: int, token: int) -> None:  # control thread
        with self._cond:
            self._firsts.append((room, token))
            self._cond.notify_all()

    def _take_first(self) -> None:
        """Prefill's first token, before the room's KV landed: a streaming request gets it at
        once (non-streaming requests are unchanged; the engine reports it again later)."""
        while True:
            with self._cond:
                if not self._firsts:
                    return
                room, token = self._firsts.popleft()
                r = self._transfers.get(room)
            if r is None or r.phase != Phase.TRANSFER or r.out_ids:
                continue
            if not self._streams_early(r, token):
                continue
            now = time.time()
            r.early_first, r.out_ids = token, [token]
            r.t["first_token"] = r.t["first_token_streamed"] = r.t["last_token"] = now
            self.counters["tokens"] += 1
            self.counters["ttft_sum"] += now - r.t["submitted"]
            self.counters["ttft_count"] += 1
            self._send(r, self._event(r, [token], []))

    def _poll_cancelled(self) -> None:
        now = time.monotonic()
        with self._cond:
            rooms, self._cancel_rooms = self._cancel_rooms, set()
        if not rooms and now - self._last_poll < CANCEL_POLL_S:
            return
        self._last_poll = now
        for r in self._all():
            if r.req.room in rooms or r.client_room in rooms:
                r.is_cancelled = always
            if r.phase != Phase.DONE and r.cancel_requested():
                r.cancelled = True
                self._cancel_one(r)

    def _cancel_one(self, r: ActiveRequest) -> None:
        if r.phase == Phase.WAITING:
            with self._cond:
                if r in self._waiting:
                    self._waiting.remove(r)
            self._refuse(r.req, "client cancelled")
        elif r.phase == Phase.TRANSFER:  # pages stay with the room until it is released
            self.receiver.abort(r.req.room, "client cancelled")
        elif r.phase == Phase.RUNNING and r.seq_id in self._running:
            self.engine.abort(r.seq_id)
            del self._running[r.seq_id]
        self._finish(r)

    def _expire_waiting(self) -> None:
        """A request that waited past queue_timeout_s for pages ends 'overloaded' (nothing was
        computed for it: prefill computes a room only once decode registered its pages)."""
        limit = self.params.queue_timeout_s
        now = time.monotonic()
        with self._cond:
            old = [r for r in self._waiting if now - r.queued_at > limit]
            for r in old:
                self._waiting.remove(r)
        for r in old:
            self.counters["overloaded"] += 1
            msg = f"overloaded, retry later: waited {limit:g}s for KV pages"
            self._refuse(r.req, msg)
            self._finish(r, error=msg, kind=errors.OVERLOADED)

    def _heartbeats(self) -> None:
        """An empty event for every request that sent nothing for HEARTBEAT_S (see module doc
        of the Triton decode model: each one lets the ensemble notice a client cancel)."""
        now = time.monotonic()
        for r in self._all():
            if r.phase != Phase.DONE and now - r.last_event >= HEARTBEAT_S:
                self._send(r, DecodeEvent(heartbeat=True))
