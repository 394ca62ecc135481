"""A decode request's state inside the decode worker, the events it emits, and the table of
every request the worker holds."""

from __future__ import annotations

import enum
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ...runtime.detok import TextState
from ...runtime.prefix_cache import Lease
from ...runtime.sampling_params import TokenLogprob
from ..request import StageRequest


class Phase(enum.IntEnum):
    """Where a decode request is; it only moves forward."""

    WAITING = 0  # queued for destination pages
    TRANSFER = 1  # pages registered with prefill, KV in flight
    RUNNING = 2  # in the engine's continuous batch
    DONE = 3  # final event sent; pages freed, or quarantined until the room's release


@dataclass
class DecodeEvent:
    token_ids: list[int] = field(default_factory=list)  # new tokens (all when stream=False)
    text: str = ""  # the text they add (stop strings cut, held back while one may start)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per token, when asked for
    final: bool = False
    error: str | None = None
    error_kind: str | None = None  # errors.INVALID / OVERLOADED / INTERNAL
    finish_reason: str | None = None
    heartbeat: bool = False  # no tokens: lets the serving layer check for a client cancel
    cached_tokens: int = 0  # prompt tokens served from a prefix cache (usage reports them)


Emit = Callable[[DecodeEvent], None]


@dataclass
class ActiveRequest:
    req: StageRequest
    emit: Emit
    is_cancelled: Callable[[], bool] | None
    pages: dict[str, list[int]] = field(default_factory=dict)  # role -> pages ("target", draft)
    lease: Lease | None = None  # its target pages in a cached pool (decode.worker._alloc)
    cached_tokens: int = 0  # prompt tokens the prefill side served from its prefix cache
    phase: Phase = Phase.WAITING
    cancelled: bool = False
    out_ids: list[int] = field(default_factory=list)
    out_logprobs: list[TokenLogprob] = field(default_factory=list)
    text: TextState | None = None  # detokenization + stop strings (None: no tokenizer)
    echoed: bool = False  # the prompt's text went out (echo)
    t: dict = field(default_factory=dict)  # timestamps for the trace
    last_event: float = 0.0  # time.monotonic() of the last event sent (heartbeats)
    queued_at: float = 0.0  # time.monotonic() when it started waiting for pages
    early_first: int | None = None  # first token streamed before the KV landed (not yet
    # seen again from the engine, whose first step reports it once more)
    origin: int = 0  # the room the client's request arrived with (failover gives fresh rooms)
    attempts: int = 0  # re-dispatches to another prefill server so far (failover.py)

    @property
    def seq_id(self) -> str:
        return str(self.req.room)

    @property
    def client_room(self) -> int:
        """The room cancels name: the request's first room, whatever room it has now."""
        return self.origin or self.req.room

    def cancel_requested(self) -> bool:
        if self.cancelled or self.is_cancelled is None:
            return False
        try:
            return bool(self.is_cancelled())
        except Exception:  # the response sender is gone: the client is too
            return True


class Requests:
    """Every request a decode worker holds, by phase, under ONE condition: the loop thread waits
    on it, and every hand-off from another thread (a submit, the control plane's callbacks, a
    cancel, a re-dispatch) notifies it. Running requests are the loop thread's alone."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.waiting: deque[ActiveRequest] = deque()  # no pages yet (FIFO)
        self.transfers: dict[int, ActiveRequest] = {}  # room -> holds pages, KV in flight
        self.running: dict[str, ActiveRequest] = {}  # seq id -> in the engine

    def all(self) -> list[ActiveRequest]:
        with self.cond:
            return [*self.waiting, *self.transfers.values(), *self.running.values()]

    def holds(self, room: int) -> bool:
        """Holds ``cond``. Whether a request with the room id ``room`` is held in any phase."""
        queued = any(r.req.room == room for r in self.waiting)
        return room in self.transfers or str(room) in self.running or queued


def always() -> bool:
    return True
