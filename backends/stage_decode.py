"""Decode stage core (no Triton): receive prompt KV from prefill, continuous-batching decode.

One :class:`DecodeWorker` per decode instance owns the model runner, its KV pool, a
:class:`~kvtransfer.KVReceiver` and an :class:`~backends.engine.LLMEngine` driven by ONE
background thread. Per request (:meth:`DecodeWorker.submit`, any thread):

1. allocate pages for ``prompt + max_tokens - 1`` tokens (FIFO-queued while the pool is full) and
   register them with the prefill bootstrap address(es) of the request, while prefill computes;
2. when the room reaches Success, hand the pages and the first token to the engine
   (``add_prefilled``, which owns the pages from then on);
3. each engine step emits the new tokens through the request's ``emit`` callback.

A failed transfer, a client cancel (``is_cancelled``) or an engine error ends the request with
one final event; its pages are freed exactly once (by this worker before step 2, by the engine
after it).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtransfer import KVReceiver, RoomStatus

from .cancel_channel import CancelListener
from .engine import LLMEngine
from .runner import ModelRunner
from .sampler import SamplingParams
from .stage_params import StageParams

log = logging.getLogger(__name__)

PREFIX_WINDOW = 8  # earlier tokens sent along with new ones, for incremental detokenization
CANCEL_POLL_S = 0.05


@dataclass
class DecodeRequest:
    room: int
    prompt_ids: list[int]
    params: SamplingParams
    bootstrap_addrs: list[str]
    stream: bool = True


@dataclass
class DecodeEvent:
    token_ids: list[int]  # new tokens (all of them when stream=False)
    prefix_ids: list[int]  # up to PREFIX_WINDOW tokens emitted before token_ids
    final: bool = False
    error: str | None = None
    finish_reason: str | None = None


Emit = Callable[[DecodeEvent], None]


@dataclass
class _Req:
    req: DecodeRequest
    emit: Emit
    is_cancelled: Callable[[], bool] | None
    pages: list[int] = field(default_factory=list)
    phase: str = "waiting"  # waiting (pages) -> transfer -> running -> done
    cancelled: bool = False
    out_ids: list[int] = field(default_factory=list)
    t: dict = field(default_factory=dict)


class DecodeWorker:
    def __init__(self, params: StageParams, runner: ModelRunner | None = None, name="decode"):
        self.params = params
        self.runner = runner or ModelRunner.load(
            params.model_path, dtype=params.dtype, device=params.device
        )
        self.pool = self.runner.make_pool(params.num_pages, params.page_size)
        self.engine = LLMEngine(self.runner, self.pool, params.max_batch, params.max_context)
        cfg = params.transfer_config()
        self.receiver = KVReceiver(cfg, {"target": self.pool.layout})
        # clients cancel through this channel too (see backends/cancel_channel.py)
        self.cancel_listener = CancelListener(cfg.host, self.cancel, cfg.shared_secret)
        self.cancel_addr = self.cancel_listener.addr
        self._cancel_rooms: set[int] = set()
        self.name = name
        self._cond = threading.Condition()
        self._waiting: deque[_Req] = deque()  # no pages yet (FIFO)
        self._transfers: dict[int, _Req] = {}  # room -> registered, KV in flight
        self._ready: deque[tuple[int, RoomStatus]] = deque()  # rooms ended (control thread)
        self._running: dict[str, _Req] = {}  # seq id -> in the engine
        self.counters = dict.fromkeys(
            ("requests", "failed", "cancelled", "steps", "max_batch", "last_batch", "tokens"), 0
        )
        self.counters.update(ttft_sum=0.0, ttft_count=0, itl_sum=0.0, itl_count=0)
        self._stop = False
        self._last_cancel_poll = 0.0
        self._thread = threading.Thread(target=self._loop, name=f"{name}-loop", daemon=True)
        self._thread.start()

    # ---- public API (any thread) -------------------------------------------------------------
    def validate(self, req: DecodeRequest) -> None:
        n, m = len(req.prompt_ids), req.params.max_tokens
        if n == 0:
            raise ValueError("prompt is empty: at least one token is required")
        if n + m > self.params.max_context:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({m}) = {n + m} exceeds the context limit"
                f" of {self.params.max_context} tokens"
            )
        need = self.pool.pages_needed(n + m - 1)
        if need > self.pool.num_pages:
            raise ValueError(
                f"request needs {need} KV pages, the decode pool has only {self.pool.num_pages}"
            )
        if not req.bootstrap_addrs:
            raise ValueError("no prefill bootstrap address")

    def submit(
        self, req: DecodeRequest, emit: Emit, is_cancelled: Callable[[], bool] | None = None
    ) -> None:
        """Queue a request; raises ValueError (nothing queued) when it can never run."""
        try:
            self.validate(req)
        except ValueError as e:
            self._refuse(req, str(e))
            raise
        r = _Req(req, emit, is_cancelled)
        r.t["submitted"] = time.time()
        with self._cond:
            if req.room in self._transfers or str(req.room) in self._running:
                raise ValueError(f"room {req.room} is already in use")
            self.counters["requests"] += 1
            self._waiting.append(r)
        self._register_waiting()
        with self._cond:
            self._cond.notify_all()

    def _refuse(self, req: DecodeRequest, reason: str) -> None:
        """Tell prefill at once that this room will never be taken, so it frees its pages
        now instead of after ``bootstrap_timeout_s`` (best effort)."""
        if not req.bootstrap_addrs:
            return
        try:
            n = len(req.prompt_ids)
            self.receiver.register(req.room, req.bootstrap_addrs, {"target": []}, n, _noop)
            self.receiver.abort(req.room, f"decode refused the request: {reason}")
        except Exception:
            log.debug("%s: room %d: refusing at prefill failed", self.name, req.room)

    def cancel(self, room: int) -> None:
        """Stop a request (any thread): its pages are freed, it ends with a final event."""
        with self._cond:
            self._cancel_rooms.add(room)
            self._cond.notify_all()

    @property
    def pages_in_use(self) -> int:
        return self.pool.num_pages - self.pool.num_free

    def stats(self) -> dict:
        snap = self.receiver.stats()
        with self._cond:
            snap.update(self.counters)
            snap["waiting"] = len(self._waiting) + len(self._transfers) + len(self.engine.waiting)
            snap["running"] = len(self.engine.running)
        snap["pages_in_use"] = self.pages_in_use
        snap["num_pages"] = self.pool.num_pages
        return snap

    def close(self) -> None:
        self._stop = True
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout=10)
        self.cancel_listener.close()
        self.receiver.close()

    # ---- registration ------------------------------------------------------------------------
    def _register_waiting(self) -> None:
        """Give pages to waiting requests in FIFO order and register them with prefill."""
        while True:
            with self._cond:
                if not self._waiting:
                    return
                r = self._waiting[0]
                n = len(r.req.prompt_ids) + r.req.params.max_tokens - 1
                need = self.pool.pages_needed(n)
                if need > self.pool.num_free:
                    return
                self._waiting.popleft()
                r.pages = self.pool.alloc(need)
                r.phase = "transfer"
                self._transfers[r.req.room] = r
            try:
                self.receiver.register(
                    r.req.room,
                    r.req.bootstrap_addrs,
                    {"target": r.pages},
                    len(r.req.prompt_ids),
                    self._on_release,
                )
                r.t["registered"] = time.time()
            except Exception as e:  # bad address etc.: this request only
                with self._cond:
                    self._transfers.pop(r.req.room, None)
                self.pool.free(r.pages)
                self._finish(r, error=f"registering KV pages with prefill failed: {e}")

    def _on_release(self, room: int, status: RoomStatus) -> None:  # control thread
        with self._cond:
            self._ready.append((room, status))
            self._cond.notify_all()

    # ---- loop thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop:
            with self._cond:
                if not (self._ready or self._cancel_rooms or self.engine.has_unfinished()):
                    self._cond.wait(CANCEL_POLL_S)
            try:
                self._poll_cancelled()
                self._take_ready()
                self._register_waiting()
                if self.engine.has_unfinished():
                    self._step()
            except Exception:
                log.exception("%s: decode loop iteration failed", self.name)
                self._fail_running("decode step failed (see server log)")

    def _take_ready(self) -> None:
        while True:
            with self._cond:
                if not self._ready:
                    return
                room, status = self._ready.popleft()
                r = self._transfers.pop(room, None)
            if r is None:
                continue
            r.t["transfer_done"] = time.time()
            if r.cancelled or status != RoomStatus.Success:
                self.pool.free(r.pages)
                why = self.receiver.failure_reason(room) or status.name
                self._finish(r, error=None if r.cancelled else f"KV transfer failed: {why}")
                continue
            try:
                first, _extra = self.receiver.result(room)
                self.receiver.forget(room)
                self.engine.add_prefilled(str(room), r.req.prompt_ids, r.pages, first, r.req.params)
            except Exception as e:
                self.pool.free(r.pages)
                self._finish(r, error=f"decode could not take the prefilled request: {e}")
                continue
            r.phase = "running"
            self._running[str(room)] = r

    def _step(self) -> None:
        batch = len(self.engine.running)
        out = self.engine.step()
        now = time.time()
        c = self.counters
        c["steps"] += 1
        c["last_batch"] = batch
        c["max_batch"] = max(c["max_batch"], batch)
        reasons = {s.seq_id: s.finish_reason for s in out.finished}
        for seq_id in set(out.new_tokens) | set(reasons):
            r = self._running.get(seq_id)
            if r is None:
                continue
            tokens = out.new_tokens.get(seq_id, [])
            c["tokens"] += len(tokens)
            if "first_token" not in r.t:
                r.t["first_token"] = now
                c["ttft_sum"] += now - r.t["submitted"]
                c["ttft_count"] += 1
            else:
                c["itl_sum"] += now - r.t["last_token"]
                c["itl_count"] += 1
            r.t["last_token"] = now
            final = seq_id in reasons
            if r.req.stream and tokens and not final:
                self._send(r, DecodeEvent(tokens, r.out_ids[-PREFIX_WINDOW:]))
            r.out_ids += tokens
            if final:
                del self._running[seq_id]
                self._finish(r, reason=reasons[seq_id], tokens=tokens)

    def _send(self, r: _Req, ev: DecodeEvent) -> bool:
        try:
            r.emit(ev)
            return True
        except Exception as e:  # the client is gone: stop generating for it
            log.info("%s: room %d: emit failed (%s); aborting", self.name, r.req.room, e)
            r.cancelled = True
            if str(r.req.room) in self._running:
                self.engine.abort(str(r.req.room))
                del self._running[str(r.req.room)]
            return False

    def _finish(self, r: _Req, error=None, reason=None, tokens=None) -> None:
        if r.phase == "done":
            return
        r.phase = "done"
        r.t["finished"] = time.time()
        if error:
            self.counters["failed"] += 1
            ev = DecodeEvent([], [], final=True, error=error)
        elif r.cancelled:
            self.counters["cancelled"] += 1
            ev = DecodeEvent([], [], final=True, finish_reason="cancelled")
        elif r.req.stream:
            prefix = r.out_ids[: len(r.out_ids) - len(tokens)][-PREFIX_WINDOW:]
            ev = DecodeEvent(list(tokens), prefix, final=True, finish_reason=reason)
        else:
            ev = DecodeEvent(list(r.out_ids), [], final=True, finish_reason=reason)
        self._send(r, ev)
        self._trace(r, error)

    def _poll_cancelled(self) -> None:
        now = time.monotonic()
        with self._cond:
            rooms, self._cancel_rooms = self._cancel_rooms, set()
        if not rooms and now - self._last_cancel_poll < CANCEL_POLL_S:
            return
        self._last_cancel_poll = now
        for r in self._all():
            if r.req.room in rooms:
                r.is_cancelled = _yes
        with self._cond:
            waiting = [r for r in self._waiting if _cancelled(r)]
            for r in waiting:
                self._waiting.remove(r)
            transfers = [r for r in self._transfers.values() if not r.cancelled and _cancelled(r)]
        for r in waiting:
            r.cancelled = True
            self._finish(r)
        for r in transfers:
            r.cancelled = True  # on_release -> _take_ready frees the pages
            self.receiver.abort(r.req.room, "client cancelled")
        for seq_id, r in list(self._running.items()):
            if _cancelled(r):
                r.cancelled = True
                self.engine.abort(seq_id)
                del self._running[seq_id]
                self._finish(r)

    def _all(self) -> list[_Req]:
        with self._cond:
            return [*self._waiting, *self._transfers.values(), *self._running.values()]

    def _fail_running(self, error: str) -> None:
        for seq_id, r in list(self._running.items()):
            self.engine.abort(seq_id)
            del self._running[seq_id]
            self._finish(r, error=error)

    def _trace(self, r: _Req, error: str | None) -> None:
        if not self.params.trace_dir:
            return
        rec = {"stage": "decode", "room": r.req.room, "error": error, "cancelled": r.cancelled}
        rec.update(r.t, tokens=len(r.out_ids))
        path = os.path.join(self.params.trace_dir, f"{self.name}-{os.getpid()}.jsonl")
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")


def _noop(*_args) -> None:
    pass


def _yes() -> bool:
    return True


def _cancelled(r: _Req) -> bool:
    if r.cancelled or r.is_cancelled is None:
        return False
    try:
        return bool(r.is_cancelled())
    except Exception:
        return True
