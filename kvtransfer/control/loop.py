"""The control loop both sides share: one thread owns every ZMQ socket and every room.

API calls from other threads become commands (``self.call``) that the loop runs in order; a
pipe wakes the loop at once; callers wait for a command with a deadline (``call_sync``). Status
changes happen under ``self.cond`` so ``poll``/``wait`` are consistent; release callbacks run on
the loop thread, outside the lock, exactly once per room. Frames that do not verify (garbage,
truncated, unknown version, unsigned or wrongly signed, stale or replayed) are dropped and
counted by kind, with rate-limited logging. An exception anywhere in an iteration is logged and
counted (``loop_errors``) and the loop goes on: the thread never dies while the side is open.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import zmq

from ..config import TransferConfig
from ..link.engine import Engine
from ..link.faults import Faults
from ..memory.layout import EntryLayout
from ..memory.staging import StagingArea
from ..protocol import messages as m
from ..protocol.identity import fingerprint
from .state import ReleaseCallback, Room, RoomStatus, RoomTable
from .stats import TransferStats

log = logging.getLogger(__name__)

CONTROL_FRAME_BYTES = 64 << 10  # Ack / Complete / Fail / Abort / Ping / Pong: < 1 KiB each
TICK_S = 0.02
CALL_TIMEOUT_S = 10.0
CLOSE_LINGER_MS = 200  # close() gives queued frames this long to leave

__all__ = ["ControlLoop", "ReleaseCallback", "TransferFailed"]


class TransferFailed(RuntimeError):
    """A room ended Failed; carries the room and the reason."""

    def __init__(self, room: int, reason: str):
        super().__init__(f"room {room}: {reason}")
        self.room, self.reason = room, reason


class ControlLoop:
    name = "kv-control"

    def __init__(
        self,
        config: TransferConfig,
        layouts: dict[str, EntryLayout] | None = None,
        tensors: dict | None = None,
    ):
        """The side's engine over its pool entries ``layouts`` (role -> layout; None: a loop
        without a data plane, control messages only), and the pools' ``tensors`` (role ->
        tensor, optional: staging and kv_checksum read through them)."""
        self.config = config
        self.rooms = RoomTable(config.tombstones)
        self.transfer_stats = TransferStats()
        self.cond = threading.Condition()
        self.dropped: dict[str, int] = {}  # dropped frames by kind
        self.loop_errors = 0
        self.verifier = m.Verifier(config.shared_secret, config.max_message_age_s)
        self.fingerprint = (
            fingerprint(config.identity, config.shared_secret, m.PROTOCOL_VERSION)
            if config.identity is not None
            else None
        )
        self.refusals: dict[str, int] = {}  # incompatible-deployment refusals by reason
        self.ctx = zmq.Context()
        self.poller = zmq.Poller()
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self.poller.register(self._wake_r, zmq.POLLIN)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self.engine: Engine | None = None
        self.layouts: dict[str, EntryLayout] = {}
        if layouts is not None:
            self._open_engine(layouts)
        self._keep_tensors(tensors)
        self.faults = Faults.from_env()  # tests only: KVTRANSFER_FAULTS
        if self.faults.active:
            log.warning("%s: FAULT INJECTION active (%s): for tests only", self.name, self.faults)

    # ---- plumbing ----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        """The control loop runs (its endpoints are bound and served)."""
        return self._thread.is_alive() and not self._stop

    def socket(self, kind: int, max_frame: int = CONTROL_FRAME_BYTES) -> zmq.Socket:
        """A socket the loop polls; a peer sending a frame over ``max_frame`` is disconnected."""
        s = self.ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.MAXMSGSIZE, max_frame)
        self.poller.register(s, zmq.POLLIN)
        return s

    def call(self, fn: Callable, *args: Any) -> Future:
        """Run ``fn(*args)`` on the loop thread; the future holds its result or exception."""
        fut: Future = Future()
        if self._stop:
            fut.set_exception(RuntimeError(f"{self.name} is closed"))
            return fut
        self._cmds.put((fn, args, fut))
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass
        return fut

    def has_commands(self) -> bool:
        """Commands are waiting for the loop thread (long work there can yield to them)."""
        return not self._cmds.empty()

    def call_sync(self, fn: Callable, *args: Any, timeout: float = CALL_TIMEOUT_S) -> Any:
        """``call`` and wait for the result, at most ``timeout`` seconds (TimeoutError)."""
        try:
            return self.call(fn, *args).result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"{self.name}: no answer from the control loop in {timeout:g}s"
            ) from None

    def send(
        self, sock: zmq.Socket, msg: m.Message, ident: bytes | None = None, signed: bool = True
    ) -> None:
        frame = m.encode(msg, self.config.shared_secret if signed else None)
        try:
            if ident is None:
                sock.send(frame, zmq.NOBLOCK)
            else:
                sock.send_multipart([ident, frame], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # peer gone or queue full: timeouts will catch it
            log.debug("send %s failed: %s", type(msg).__name__, e)

    def drop(self, kind: str, detail: object = "") -> None:
        """Count a dropped frame or message; log the first few of each kind, then rarely."""
        if m.count_drop(self.dropped, kind):
            n = self.dropped[kind]
            log.warning(
                "%s: dropped a control frame (%s: %s) [%d so far]", self.name, kind, detail, n
            )

    def count_refusal(self, reason: str, detail: str) -> None:
        """Count an incompatible-deployment refusal (sent or received); log it rarely."""
        if m.count_drop(self.refusals, reason):
            n = self.refusals[reason]
            log.error("%s: %s [%d refusals for %s so far]", self.name, detail, n, reason)

    def decode(self, frame: bytes) -> m.Message | None:
        try:
            return self.verifier.decode(frame)
        except m.MessageError as e:
            self.drop(e.kind, e)
            return None

    def _run(self) -> None:
        while not self._stop:
            try:
                self._iteration()
            except Exception:
                if self._stop:
                    break
                self.loop_errors += 1
                log.exception(
                    "%s: control loop iteration failed (%d so far)", self.name, self.loop_errors
                )
                time.sleep(TICK_S)

    def _iteration(self) -> None:
        events = dict(self.poller.poll(TICK_S * 1000))
        if self._wake_r in events:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        while True:
            try:
                fn, args, fut = self._cmds.get_nowait()
            except queue.Empty:
                break
            try:
                fut.set_result(fn(*args))
            except Exception as e:
                fut.set_exception(e)
        for sock, ev in events.items():
            if ev & zmq.POLLIN and sock != self._wake_r:
                self._drain(sock)
        self.on_tick(time.monotonic())

    def _drain(self, sock) -> None:
        if not isinstance(sock, zmq.Socket):
            self.on_fd(sock)
            return
        for _ in range(1000):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self.on_frames(sock, frames)
            except Exception:  # one bad message never stops the loop
                self.loop_errors += 1
                log.exception("%s: handling a control frame failed", self.name)

    # ---- rooms -------------------------------------------------------------------------------
    def advance(self, r: Room, status: RoomStatus, reason: str = "") -> bool:
        with self.cond:
            changed = r.advance(status, reason)
            if changed:
                self.cond.notify_all()
        if changed and status.ended:
            self.transfer_stats.room_ended(r.room, status == RoomStatus.Success, r.reason)
            if status == RoomStatus.Failed:
                log.info("%s: room %d failed: %s", self.name, r.room, r.reason)
        return changed

    def release(self, r: Room) -> None:
        """Call the room's release callback (once) and turn the room into a tombstone."""
        if r.released or not r.status.ended:
            return
        r.released = True
        if r.on_release is not None:
            try:
                r.on_release(r.room, r.status)
            except Exception:
                log.exception("%s: on_release of room %d raised", self.name, r.room)
        with self.cond:  # waiters wake only now: the release callback has run
            self.rooms.bury(r.room)
            self.cond.notify_all()

    def poll(self, room: int) -> RoomStatus:
        with self.cond:
            st = self.rooms.status(room)
        if st is None:
            raise KeyError(f"unknown room {room}")
        return st[0]

    def failure_reason(self, room: int) -> str:
        with self.cond:
            st = self.rooms.status(room)
        return st[1] if st else ""

    def wait(self, room: int, timeout: float | None = None) -> RoomStatus:
        """Block until the room has ended and its release callback has run (or ``timeout``).

        Returns the room's status at that point (not ended when the timeout hit first).
        """
        end = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while True:
                st = self.rooms.status(room)
                if st is None:
                    raise KeyError(f"unknown room {room}")
                if st[0].ended and room not in self.rooms.live:
                    return st[0]
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return st[0]
                self.cond.wait(min(left, 0.5) if left is not None else 0.5)

    def stats(self) -> dict:
        """Totals (bytes, seconds, GB/s, failures by reason), live rooms, dropped frames."""
        snap = self.transfer_stats.snapshot()
        snap["live_rooms"] = len(self.rooms)
        snap["dropped_frames"] = dict(self.dropped)
        snap["dropped_total"] = sum(self.dropped.values())
        snap["refusals"] = dict(self.refusals)
        snap["loop_errors"] = self.loop_errors + (self.engine.worker_errors if self.engine else 0)
        return snap

    def stats_for(self, room: int) -> dict | None:
        """Per-room detail: bytes, seconds, and one record per layer group (sender side)."""
        return self.transfer_stats.get_room(room)

    def open_staging(self, tensors: dict | None, slots: int) -> StagingArea | None:
        """``slots`` staging slots of ``staging_slot_bytes`` beside the pools, registered with
        the engine (None: no tensors, or staging off)."""
        if not tensors or not self.config.staging_slot_bytes:
            return None
        area = StagingArea(tensors, self.layouts, slots, self.config.staging_slot_bytes)
        self.engine.register(area.addr, area.nbytes)
        return area

    def _keep_tensors(self, tensors: dict | None) -> None:
        """The pools' tensors (role -> tensor): kv_checksum reads the room's bytes through them."""
        self.pool_tensors = dict(tensors or {})
        missing = [r for r in self.layouts if self.pool_tensors.get(r) is None]
        if self.config.kv_checksum and missing:
            raise ValueError(f"kv_checksum needs the pools' tensors (missing: {missing})")

    def _open_engine(self, layouts: dict[str, EntryLayout]) -> None:
        """Check the entry layouts (key == role, pool address set), start the Mooncake engine
        and register every pool with it once; :meth:`close` closes it."""
        if not layouts:
            raise ValueError(f"{type(self).__name__} needs at least one entry layout")
        for role, lay in layouts.items():
            if lay.role != role or not lay.base_addr:
                raise ValueError(f"layout {role!r}: role must match the key and base_addr be set")
        self.layouts = dict(layouts)
        self.engine = Engine(self.config)
        for lay in self.layouts.values():
            self.engine.register(lay.base_addr, lay.nbytes)

    def close(self) -> None:
        if self._stop:
            return
        self._stop = True
        os.write(self._wake_w, b"x")
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
        self.ctx.destroy(linger=CLOSE_LINGER_MS)  # a last Abort or Fail still goes out
        os.close(self._wake_r)
        os.close(self._wake_w)
        if self.engine is not None:
            self.engine.close()

    # ---- for subclasses ----------------------------------------------------------------------
    def on_frames(self, sock: zmq.Socket, frames: list[zmq.Frame]) -> None:
        raise NotImplementedError

    def on_fd(self, fd) -> None:
        """A non-zmq descriptor the subclass registered became readable."""

    def on_tick(self, now: float) -> None:
        pass
