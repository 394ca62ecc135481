"""The one wrapper around Mooncake's ``TransferEngine`` (P2P handshake, no metadata server).

Setup errors raise :class:`EngineError`; transfers report a status (True/False) to a callback.
Writes go through worker threads: :meth:`Engine.submit` returns at once, a worker submits
``batch_transfer_async_write`` chunks (<= ``max_batch_entries`` copies) and waits for them with
``get_batch_transfer_status`` (a blocking call that releases the GIL), keeping at most
``max_inflight_entries`` copies in flight per engine.

That call busy-waits, so a worker that sat in it for a whole transfer would burn a CPU core that
prefill's compute needs (measured: prefill 1.1-1.6x slower while its KV streamed). The worker
therefore first sleeps (still picking up new jobs) until about 80 % of the batch's expected
completion time, estimated from a running throughput average, and only then blocks in Mooncake.

Measured with mooncake-transfer-engine(-non-cuda) 0.3.13 over loopback TCP:
* ``get_batch_transfer_status([id])`` busy-waits until the batch ends and frees the id; ids are
  recycled, so each id is waited on exactly once. ``transfer_submit_write`` /
  ``transfer_check_status`` poll without blocking but carry one copy per id.
* More than ~2048 queued copies overflow the TCP lane queue ("queue-full rejection"): that batch
  fails AND every later write to that peer fails too (seen for 10 s+). Hence the caps.
* A write to an unregistered remote address fails (-1) without harming later writes.
* Throughput is the same for sync and async batches of the same size.

Completion fences: a job may carry a ``fence`` (anything with a non-blocking ``query()`` that
turns True once the compute that wrote the job's source bytes has finished: a CUDA event on
GPUs, where kernels run asynchronously; None on CPU, where the bytes are there when the compute
call returns). The worker, never the caller, polls it before submitting any batch of the job,
and meanwhile keeps reaping batches already in flight. Jobs are submitted in FIFO order.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from ..config import TransferConfig
from ..memory.layout import Transfer
from .writer import DoneCallback, SlotWriter

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "Mooncake is not installed: `pip install mooncake-transfer-engine-non-cuda` on CPU hosts "
    "(`mooncake-transfer-engine` with CUDA 12), plus the system package libibverbs1 "
    "(`apt-get install -y libibverbs1`)."
)


class WriteTimeout(TimeoutError):
    """A blocking write did not end within its deadline (it may still be in flight)."""


class EngineError(RuntimeError):
    pass


def _preload_cudart() -> bool:
    """Mooncake's CUDA build links libcudart.so.12, which a host whose torch uses another CUDA
    major may only have inside the ``nvidia-cuda-runtime-cu12`` wheel: load it from there."""
    import ctypes
    import glob
    import importlib.util

    spec = importlib.util.find_spec("nvidia.cuda_runtime")
    for path in spec.submodule_search_locations if spec else []:
        for lib in sorted(glob.glob(os.path.join(path, "lib", "libcudart.so.12*"))):
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
            return True
    return False


def _load_transfer_engine():
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        if "libcudart.so.12" not in str(e) or not _preload_cudart():
            raise EngineError(f"{INSTALL_HINT} ({e})") from e
        from mooncake.engine import TransferEngine
    return TransferEngine


FENCE_POLL_S = 0.0005
CLOSE_JOIN_S = 5.0  # close() waits this long for each transfer worker


class Fence(Protocol):
    def query(self) -> bool:
        """True once the work the fence was recorded after has completed (non-blocking)."""


class _Job:
    """One submit(): its batches, and whether all were handed to Mooncake yet."""

    __slots__ = (
        "session",
        "transfers",
        "callback",
        "fence",
        "alive",
        "pending",
        "ok",
        "submitted",
        "reported",
    )

    def __init__(self, session, transfers: list[Transfer], callback: DoneCallback, fence, alive):
        self.session, self.transfers, self.callback = session, transfers, callback
        self.fence: Fence | None = fence
        self.alive: Callable[[], bool] | None = alive
        self.pending = 0  # batches submitted and not yet reaped
        self.ok = True
        self.submitted = False  # no more batches of this job will be submitted
        self.reported = False  # callback ran

    def fence_ready(self) -> bool:
        """True when the job's source bytes are final; a fence that raises fails the job."""
        if self.fence is None:
            return True
        try:
            if not self.fence.query():
                return False
        except Exception:
            log.exception("completion fence failed: the job fails")
            self.ok = False
        self.fence = None
        return True

    def maybe_report(self) -> None:
        # A job may span several batches; reaping its first batch before the next one is
        # submitted must not report it done, hence the `submitted` flag.
        if self.submitted and self.pending == 0 and not self.reported:
            self.reported = True
            try:
                self.callback(self.ok)
            except Exception:  # a callback bug must not kill the worker
                log.exception("transfer callback failed")


class _Batch:
    __slots__ = ("bid", "entries", "job", "nbytes", "submitted", "expected")

    def __init__(self, bid, entries, job, nbytes, submitted, expected):
        self.bid, self.entries, self.job, self.nbytes = bid, entries, job, nbytes
        self.submitted, self.expected = submitted, expected  # time.monotonic()


def bind_address(host: str) -> str:
    """The IP address Mooncake's listeners are to bind to (scripts/bind_shim.c reads it from
    ``PD_BIND_ADDR``: Mooncake 0.3.13 itself binds the wildcard address)."""
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return socket.gethostbyname(host)


class Engine:
    def __init__(self, config: TransferConfig):
        self.config = config
        if config.protocol == "tcp":
            os.environ.setdefault("MC_FORCE_TCP", "1")  # else RDMA NICs win over "tcp"
        os.environ["PD_BIND_ADDR"] = bind_address(config.host)
        cls = _load_transfer_engine()
        self._te = cls()
        rc = self._te.initialize(config.host, "P2PHANDSHAKE", config.protocol, config.rdma_device)
        if rc != 0:
            raise EngineError(
                f"Mooncake initialize({config.host!r}, P2PHANDSHAKE, {config.protocol!r},"
                f" {config.rdma_device!r}) returned {rc}; check host and RDMA device"
            )
        self.session_id = f"{config.host}:{self._te.get_rpc_port()}"
        self._regions: dict[int, int] = {}
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._per_worker = config.max_inflight_entries // config.num_workers
        self._rate = 1e9  # bytes/s estimate; refined by every completed batch
        self._busy_until = self._last_done = 0.0
        self._closed = False
        self.worker_errors = 0
        self._writers: list = []  # SlotWriters over this engine (slot_writer)
        self._workers = [
            threading.Thread(target=self._work, name=f"kv-transfer-{i}", daemon=True)
            for i in range(config.num_workers)
        ]
        for w in self._workers:
            w.start()

    @property
    def native(self):
        """Mooncake's TransferEngine itself (for :mod:`.writer`'s non-blocking single writes)."""
        return self._te

    def slot_writer(self, name: str = "kv-stage-writer"):
        """A :class:`~kvtransfer.link.writer.SlotWriter` over this engine, closed by
        :meth:`close` before any memory is unregistered."""
        w = SlotWriter(self._te, name)
        self._writers.append(w)
        return w

    # ---- memory ------------------------------------------------------------------------------
    def register(self, addr: int, length: int) -> None:
        """Register a buffer once (a second call for the same region is a no-op)."""
        if self._regions.get(addr) == length:
            return
        if addr in self._regions:
            raise EngineError(f"region at {addr:#x} already registered with another length")
        rc = self._te.register_memory(addr, length)
        if rc != 0:
            raise EngineError(f"Mooncake register_memory({addr:#x}, {length}) returned {rc}")
        self._regions[addr] = length

    def read_sync(self, session: str, local_addr: int, remote_addr: int, length: int) -> bool:
        """Blocking read of ``length`` bytes from a peer's registered memory (small reads off
        the control thread: the session-ownership proof)."""
        return self._sync("read", session, local_addr, remote_addr, length)

    def write_sync(
        self,
        session: str,
        local_addr: int,
        remote_addr: int,
        length: int,
        timeout_s: float | None = None,
    ) -> bool:
        """Blocking write of ``length`` bytes into a peer's registered memory (one TP rank's
        staged chunk, :mod:`kvtransfer.tp.shards`). Submitted, then polled with 100 us sleeps:
        Mooncake's blocking call spins and takes a core from its own TCP threads on a small host.

        False when the write failed; :class:`WriteTimeout` when it has not ended after
        ``timeout_s`` (default ``transfer_timeout_s``): it may still be in flight, so the caller
        must not reuse the source memory."""
        limit = self.config.transfer_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        try:
            tid = self._te.transfer_submit_write(session, local_addr, remote_addr, length)
            if tid is None or tid < 0:
                return False
            while (rc := self._te.transfer_check_status(tid)) == 0:
                if time.monotonic() > deadline:
                    raise WriteTimeout(f"write to {session} not done after {limit:g} s")
                time.sleep(1e-4)
            return rc == 1
        except WriteTimeout:
            raise
        except Exception as e:
            log.warning("write to %s raised %s: %s", session, type(e).__name__, e)
            return False

    def _sync(self, op: str, session: str, local: int, remote: int, length: int) -> bool:
        try:
            fn = getattr(self._te, f"transfer_sync_{op}")
            return fn(session, local, remote, length) == 0
        except Exception as e:
            log.warning("%s with %s raised %s: %s", op, session, type(e).__name__, e)
            return False

    # ---- transfers ---------------------------------------------------------------------------
    def submit(
        self,
        session: str,
        transfers: list[Transfer],
        callback: DoneCallback,
        fence: Fence | None = None,
        alive: Callable[[], bool] | None = None,
    ) -> None:
        """Queue writes; ``callback(ok)`` runs once, on a worker thread, when all have ended.
        No batch is handed to Mooncake before ``fence`` (if any) reports completion; a job
        whose ``alive()`` is False by then (its room ended) is reported failed, unsent."""
        if self._closed:
            raise EngineError("engine is closed")
        self._queue.put(_Job(session, transfers, callback, fence, alive))

    def _work(self) -> None:
        """A transfer worker: never dies while the engine is open (errors are counted)."""
        while True:
            try:
                self._work_loop()
                return
            except Exception:
                self.worker_errors += 1
                log.exception("transfer worker iteration failed; restarting it")
                time.sleep(0.01)

    def _work_loop(self) -> None:
        inflight: deque[_Batch] = deque()
        fenced: deque[_Job] = deque()  # the head job, while its compute fence is pending
        load = 0
        while True:
            if fenced:
                job = fenced.popleft()
            elif inflight:
                job = self._get(self._sleep_for(inflight[0]))
            elif self._closed and self._queue.empty():
                return
            else:
                job = self._get(0.5)
            if job is not None and not job.fence_ready():
                fenced.append(job)  # FIFO: later jobs wait behind it
                if not (inflight and self._sleep_for(inflight[0]) <= 0):
                    time.sleep(FENCE_POLL_S)
                    continue
                job = None
            if job is not None:
                load = self._submit_job(job, inflight, load)
            elif inflight and self._sleep_for(inflight[0]) <= 0:
                load -= self._reap(inflight)

    def _submit_job(self, job: _Job, inflight: deque[_Batch], load: int) -> int:
        """Hand a job's chunks to Mooncake (waiting for room in flight); returns the new load."""
        step = self.config.max_batch_entries
        if job.alive is not None and job.ok and not job.alive():
            job.ok = False  # its room ended while it waited: nothing of it goes out
        for i in range(0, len(job.transfers), step):
            chunk = job.transfers[i : i + step]
            while inflight and load + len(chunk) > self._per_worker:
                time.sleep(self._sleep_for(inflight[0]))
                load -= self._reap(inflight)
            if not job.ok:  # an earlier chunk failed: don't send the rest
                break
            try:
                bid = self._te.batch_transfer_async_write(
                    job.session,
                    [t.src for t in chunk],
                    [t.dst for t in chunk],
                    [t.length for t in chunk],
                )
            except Exception as e:  # e.g. TypeError for a bad address: this job fails, only
                log.warning("batch submit to %s raised %s: %s", job.session, type(e).__name__, e)
                bid = None
            if not bid or bid < 0:
                log.warning("batch submit to %s failed (%s)", job.session, bid)
                job.ok = False
                break
            job.pending += 1
            inflight.append(self._batch(bid, chunk, job))
            load += len(chunk)
        job.submitted = True
        job.maybe_report()
        return load

    def _batch(self, bid: int, chunk: list[Transfer], job: _Job) -> _Batch:
        nbytes = sum(t.length for t in chunk)
        now = time.monotonic()
        start = max(now, self._busy_until)  # batches to one engine are served one after another
        self._busy_until = start + nbytes / self._rate
        return _Batch(bid, len(chunk), job, nbytes, now, self._busy_until)

    @staticmethod
    def _sleep_for(b: _Batch) -> float:
        """Seconds to sleep before blocking on batch ``b`` (0: block now)."""
        left = b.submitted + 0.8 * (b.expected - b.submitted) - time.monotonic()
        return left if left > 0.001 else 0.0

    def _get(self, timeout: float) -> _Job | None:
        try:
            if timeout <= 0:
                return self._queue.get_nowait()
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def _reap(self, inflight: deque[_Batch]) -> int:
        b = inflight.popleft()
        try:
            rc = self._te.get_batch_transfer_status([b.bid])  # busy-waits, GIL released
        except Exception as e:
            log.warning("status of batch to %s raised %s: %s", b.job.session, type(e).__name__, e)
            rc = -1
        now = time.monotonic()
        if rc != 0:
            log.warning("batch to %s failed (status %s)", b.job.session, rc)
            b.job.ok = False
        else:  # running throughput estimate (bytes/s) that the next sleeps are based on
            began = max(b.submitted, self._last_done)
            if now > began:
                rate = b.nbytes / (now - began)
                self._rate = min(max(0.7 * self._rate + 0.3 * rate, 1e7), 1e11)
        self._last_done = now
        if not inflight:
            self._busy_until = now
        b.job.pending -= 1
        b.job.maybe_report()
        return b.entries

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for _ in self._workers:
            self._queue.put(None)
        stopped = all([w.close() for w in self._writers])
        for w in self._workers:
            w.join(timeout=CLOSE_JOIN_S)
        busy = [w.name for w in self._workers if w.is_alive()] + ([] if stopped else ["writer"])
        if busy:  # a write may still read registered memory: never unregister under it
            log.error(
                "engine close: %s still busy after %g s; memory stays registered",
                busy,
                CLOSE_JOIN_S,
            )
            return
        for addr in list(self._regions):
            self._te.unregister_memory(addr)
        self._regions.clear()
