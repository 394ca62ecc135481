"""Publishes a prefix cache's events on ZMQ as vLLM's ``ZmqEventPublisher`` does, so a router
that subscribes to vLLM pods subscribes to these the same way.

Wire (vLLM ``VLLM_MIRRORED``, :mod:`.events`):

* **PUB** socket, multipart ``[topic, seq, payload]``: ``topic`` the configured bytes (llm-d
  expects ``kv@<pod ip>@<model>``; Dynamo none), ``seq`` the batch's sequence number as 8 bytes
  big-endian (0, 1, 2, ... per publisher), ``payload`` one msgpack :class:`~.events.KVEventBatch`.
  The endpoint is bound or connected by vLLM's rule: bound when it has ``*`` or ``::`` or is
  ``ipc://`` / ``inproc://``, else connected (llm-d's scheduler binds a SUB that pods connect
  to); ``bind`` overrides the rule, so ``tcp://10.0.0.5:5557`` with ``bind=True`` listens on
  that host only.
* **ROUTER** replay socket (optional, always bound): a client (DEALER or REQ) sends ``[b"",
  start_seq]`` (8 bytes big-endian) and gets every buffered batch with ``seq >= start_seq`` as
  ``[b"", topic, seq, payload]``, then ``[b"", b"", -1 as 8 signed big-endian bytes, b""]``.
  The buffer keeps the last ``buffer_steps`` batches.

The cache calls :meth:`KVEventPublisher.put` under its pool's lock: it only appends to a bounded
queue (a full queue drops the events and counts them in ``dropped``: a subscriber that sees a
gap in ``seq`` can replay, but dropped events were never numbered). One thread takes everything
queued, sends it as one batch, and serves replay requests; it logs and goes on after an error.
The owner (a stage) makes it, hands ``put`` to the cache, and calls :meth:`close`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import zmq

from .events import KVEvent, KVEventBatch, encode_batch

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard and ipc/inproc endpoints, connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """``endpoint``: the PUB address; ``topic``: the first frame; ``replay_endpoint``: the
    ROUTER address (None: no replay); ``buffer_steps``: batches kept for replay;
    ``max_queue``: events waiting to be sent; ``max_batch``: events per batch at most;
    ``data_parallel_rank``: stamped on every batch as vLLM does; ``bind``: see the module."""

    def __init__(
        self,
        endpoint: str,
        topic: str = "",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        max_queue: int = 100_000,
        max_batch: int = 1024,
        hwm: int = 100_000,
        data_parallel_rank: int = 0,
        bind: bool | None = None,
        context: zmq.Context | None = None,
    ):
        for name, v in (("buffer_steps", buffer_steps), ("max_queue", max_queue)):
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if not isinstance(max_batch, int) or max_batch <= 0:
            raise ValueError(f"max_batch must be a positive integer, got {max_batch!r}")
        self.topic = topic.encode()
        self.rank = data_parallel_rank
        self.max_batch = max_batch
        self.dropped = 0  # events refused by a full queue
        self.sent = 0  # batches sent
        self._queue: queue.Queue[list[KVEvent]] = queue.Queue(maxsize=max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._ctx = context or zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.set_hwm(hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            (self._pub.bind if (binds(endpoint) if bind is None else bind) else self._pub.connect)(
                endpoint
            )
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
        except Exception:
            self._close_sockets()
            raise
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
        self.replay_endpoint = (
            self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay else None
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    # ---- the cache's side --------------------------------------------------------------------
    def put(self, events: list[KVEvent]) -> None:
        """Queue events to send (never blocks; a full queue drops them)."""
        try:
            self._queue.put_nowait(list(events))
        except queue.Full:
            self.dropped += len(events)

    # ---- the thread ----------------------------------------------------------------------------
    def _take(self, timeout: float) -> list[KVEvent]:
        try:
            events = self._queue.get(timeout=timeout)
        except queue.Empty:
            return []
        while len(events) < self.max_batch:
            try:
                events += self._queue.get_nowait()
            except queue.Empty:
                break
        return events

    def _send(self, events: list[KVEvent]) -> None:
        batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.rank)
        payload = encode_batch(batch)
        seq = self._seq.to_bytes(8, "big")
        self._pub.send_multipart((self.topic, seq, payload))
        self._buffer.append((self._seq, payload))
        self._seq += 1
        self.sent += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("KV events: invalid replay request of %d frames", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                frames = (client, b"", self.topic, seq.to_bytes(8, "big"), payload)
                self._replay.send_multipart(frames)
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _run(self) -> None:
        while not self._stop.is_set() or not self._queue.empty():
            try:
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                events = self._take(0.05)
                if events:
                    self._send(events)
            except Exception:
                log.exception("KV events publisher: error (going on)")
                time.sleep(0.05)

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (for at most ``timeout`` s), stop the thread, close the sockets."""
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("KV events publisher did not stop within %.1f s", timeout)
            return  # the daemon thread still owns the sockets
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
