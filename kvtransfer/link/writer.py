"""Large single writes (staged chunks) with non-blocking completion polling.

Mooncake's ``get_batch_transfer_status`` busy-waits until a batch ends; for a few large writes
that keep the link busy for tens of milliseconds, a thread spinning in it takes a core from
Mooncake's own TCP threads and from the gather/scatter copies (2-core host: staged GQA at page
16 reached 0.21-0.36 GB/s of a 0.5 GB/s link with it). ``transfer_submit_write`` /
``transfer_check_status`` (1 done, 0 pending, < 0 failed) do not block: one thread submits
each write once its fence is done and polls every write in flight with short sleeps.

:meth:`SlotWriter.close` takes no new write, fails the ones not started, and waits (bounded)
for the ones in flight: the engine unregisters its memory only once they ended.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable

from ..memory.layout import Transfer

log = logging.getLogger(__name__)

DoneCallback = Callable[[bool], None]  # ok: the write (or every write of a job) landed
POLL_S = 0.0002
NICE = 10
CLOSE_WAIT_S = 10.0  # close() waits this long for the writes in flight


class SlotWriter:
    def __init__(self, te, name: str = "kv-stage-writer"):
        self._te = te
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._inflight = 0  # writes handed to Mooncake and not ended
        self.errors = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, session: str, t: Transfer, callback: DoneCallback, fence=None) -> None:
        """Write ``t`` once ``fence`` (if any) reports done; ``callback(ok)`` runs once, on
        this writer's thread."""
        if self._closed:
            _report(callback, False)
            return
        self._queue.put((session, t, callback, fence))

    def _run(self) -> None:
        try:  # a poller: let compute threads win the CPU (Linux: per-thread nice)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
        except (AttributeError, OSError):
            pass
        while not self._closed:
            try:
                self._loop()
            except Exception:  # never dies while open
                self.errors += 1
                log.exception("stage writer iteration failed; restarting it")
                time.sleep(0.01)

    def _loop(self) -> None:
        waiting: list = []  # (session, transfer, callback, fence) whose fence is pending
        inflight: list = []  # (id, callback)
        while not self._closed:
            block = not waiting and not inflight
            try:
                waiting.append(self._queue.get(timeout=0.5) if block else self._queue.get_nowait())
                continue
            except queue.Empty:
                pass
            still = []
            for job in waiting:
                ready = _fence_done(job[3])
                if ready is None:  # the fence failed: so does the write
                    _report(job[2], False)
                elif ready:
                    inflight.append(self._start(*job[:3]))
                else:
                    still.append(job)
            waiting = still
            inflight = [j for j in inflight if j is not None and not self._done(*j)]
            self._inflight = len(inflight)
            if waiting or inflight:
                time.sleep(POLL_S)
        for job in waiting:  # closed: what did not start fails, what started is awaited
            _report(job[2], False)
        self._drain(inflight)

    def _drain(self, inflight: list) -> None:
        end = time.monotonic() + CLOSE_WAIT_S
        while inflight and time.monotonic() < end:
            inflight = [j for j in inflight if j is not None and not self._done(*j)]
            self._inflight = len(inflight)
            time.sleep(POLL_S)
        while True:  # submitted after the loop stopped: never started
            try:
                _report(self._queue.get_nowait()[2], False)
            except queue.Empty:
                break

    def _start(self, session: str, t: Transfer, callback: DoneCallback):
        try:
            tid = self._te.transfer_submit_write(session, t.src, t.dst, t.length)
        except Exception as e:
            log.warning("write to %s raised %s: %s", session, type(e).__name__, e)
            tid = None
        if tid is None or tid < 0:
            _report(callback, False)
            return None
        return tid, callback

    def _done(self, tid: int, callback: DoneCallback) -> bool:
        try:
            rc = self._te.transfer_check_status(tid)
        except Exception as e:
            log.warning("status of write %s raised %s: %s", tid, type(e).__name__, e)
            rc = -1
        if rc == 0:
            return False
        if rc != 1:
            log.warning("staged write failed (status %s)", rc)
        _report(callback, rc == 1)
        return True

    def close(self) -> bool:
        """Stop; True once no write of this writer can still be in flight."""
        self._closed = True
        self._thread.join(timeout=CLOSE_WAIT_S + 5)
        return not self._thread.is_alive() and self._inflight == 0


def _fence_done(fence) -> bool | None:
    if fence is None:
        return True
    try:
        return bool(fence.query())
    except Exception:
        log.exception("completion fence failed: the write fails")
        return None


def _report(callback: DoneCallback, ok: bool) -> None:
    try:
        callback(ok)
    except Exception:
        log.exception("write callback failed")
