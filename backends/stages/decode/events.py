"""What a decode request's client hears: its events, its ONE final event, and a heartbeat while it
has nothing to send (loop thread).

Every event goes through the request's ``emit`` callback. An ``emit`` that raises means the client
is gone: the request is cancelled at once (``on_gone``, the worker's cancel of one request). A
heartbeat (an empty event every ``HEARTBEAT_S``) lets the serving layer notice a client cancel in
every phase (see the Triton decode model's module doc).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ...runtime.tokenizer import Tokenizer
from .. import errors
from ..latency import Observations
from ..trace import TraceWriter
from .state import ActiveRequest, DecodeEvent, Phase

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.25  # a request with nothing to send gets an empty event this often


class Responder:
    """Builds and sends a decode worker's events. ``counters`` is the worker's (``failed``,
    ``cancelled``); ``on_gone(request)`` runs when a request's ``emit`` raised before it ended."""

    def __init__(
        self,
        name: str,
        tok: Tokenizer | None,
        counters: dict,
        latency: Observations,
        trace: TraceWriter,
        on_gone: Callable[[ActiveRequest], None],
    ):
        self.name, self.tok, self.counters = name, tok, counters
        self.latency, self.trace, self.on_gone = latency, trace, on_gone

    def send(self, r: ActiveRequest, ev: DecodeEvent) -> bool:
        r.last_event = time.monotonic()
        try:
            r.emit(ev)
            return True
        except Exception as e:  # the client is gone: stop generating for it
            log.info("%s: room %d: emit failed (%s); aborting", self.name, r.req.room, e)
            if r.phase != Phase.DONE:
                r.cancelled = True
                self.on_gone(r)
            return False

    def finish(self, r, error=None, reason=None, tokens=(), logprobs=(), kind=errors.INTERNAL):
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
            ev = self.event(r, tokens, logprobs, final=True, finish_reason=reason)
        else:
            ev = self.event(r, r.out_ids, r.out_logprobs, final=True, finish_reason=reason)
        self.send(r, ev)
        self.trace.write(
            {
                "stage": "decode",
                "room": r.req.room,
                "error": error,
                "cancelled": r.cancelled,
                **r.t,
                "tokens": len(r.out_ids),
            }
        )

    def event(self, r: ActiveRequest, tokens, logprobs, final=False, **kw) -> DecodeEvent:
        """An event with ``tokens`` and the text they add (the prompt's first, with echo)."""
        text = r.text.take(final) if r.text is not None else ""
        if r.req.echo and not r.echoed:
            r.echoed = True
            text = (self.tok.decode(r.req.prompt_ids) if self.tok else "") + text
        kw.setdefault("cached_tokens", r.cached_tokens)
        return DecodeEvent(list(tokens), text, list(logprobs), final=final, **kw)

    def heartbeats(self, requests: list[ActiveRequest]) -> None:
        """An empty event for every request that sent nothing for HEARTBEAT_S."""
        now = time.monotonic()
        for r in requests:
            if r.phase != Phase.DONE and now - r.last_event >= HEARTBEAT_S:
                self.send(r, DecodeEvent(heartbeat=True))


def streams_early(r: ActiveRequest, token: int, eos_ids) -> bool:
    """Whether prefill's first token may go out before the KV landed: only when it cannot be the
    last one (a stream never ends with an empty extra event) and carries no logprobs (they come
    with the KV)."""
    sp = r.req.sampling
    if not r.req.stream or sp.max_tokens < 2 or sp.logprobs is not None:
        return False
    if token in sp.stop_token_ids or (token in eos_ids and not sp.ignore_eos):
        return False
    return r.text is None or not r.text.update([token])  # a stop string ends it here
