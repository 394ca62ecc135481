"""Client-cancel side channel: postprocess -> decode, one
:class:`~kvtransfer.protocol.messages.Cancel`.

Why: Triton ensembles cancel only the steps they schedule AFTER the client cancelled, never the
step already running. Decode's request is running for the whole generation, so it never sees
``is_cancelled()``; the next postprocess step (scheduled per decode response) does. Postprocess
then tells the decode instance (its address travels with every decode response) to stop.

The frames are kvtransfer control messages (same versioned envelope, same HMAC with a shared
secret, same freshness window and replay check as the transfer's control plane): one wire
protocol for the whole product. Frames that do not decode to a fresh Cancel are dropped and
counted; the first few of each kind are logged, then only at powers of two.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import zmq

from kvtransfer import messages as m

log = logging.getLogger(__name__)

MAX_CANCEL_FRAME = 256  # a signed Cancel is ~70 bytes


class CancelListener:
    """PULL socket on ``host`` (random port); calls ``on_cancel(room)`` on its own thread."""

    def __init__(
        self,
        host: str,
        on_cancel: Callable[[int], None],
        secret: bytes | None = None,
        max_age_s: float = 120.0,
    ):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_CANCEL_FRAME)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.addr = f"{host}:{port}"
        self.on_cancel = on_cancel
        self.verifier = m.Verifier(secret, max_age_s)  # used on the listener's thread only
        self.dropped_by_kind: dict[str, int] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="cancel-listener", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                if self.sock.poll(200):
                    self._handle(self.sock.recv())
            except zmq.ZMQError as e:
                if self._stop:
                    return
                log.warning("cancel channel: %s", e)
            except Exception:  # one bad frame or callback never ends the listener
                log.exception("cancel channel: handling a frame failed")

    def _handle(self, frame: bytes) -> None:
        try:
            msg = self.verifier.decode(frame)
        except m.MessageError as e:
            self._drop(e.kind, e)
            return
        if not isinstance(msg, m.Cancel):
            self._drop("unexpected", type(msg).__name__)
            return
        self.on_cancel(msg.room)

    def _drop(self, kind: str, detail: object) -> None:
        if m.count_drop(self.dropped_by_kind, kind):
            n = self.dropped_by_kind[kind]
            log.warning("cancel channel: dropped a frame (%s: %s) [%d so far]", kind, detail, n)

    @property
    def dropped(self) -> int:
        """Frames dropped, all kinds."""
        return sum(dict(self.dropped_by_kind).values())

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=2)
        self.ctx.destroy(linger=0)


class CancelSender:
    """PUSH sockets to decode instances, one per address, reused."""

    def __init__(self, secret: bytes | None = None):
        self.ctx = zmq.Context()
        self.secret = secret
        self._socks: dict[str, zmq.Socket] = {}
        self._lock = threading.Lock()

    def cancel(self, addr: str, room: int) -> None:
        with self._lock:
            sock = self._socks.get(addr)
            if sock is None:
                sock = self._socks[addr] = self.ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 1000)
                sock.connect(f"tcp://{addr}")
            sock.send(m.encode(m.Cancel(room), self.secret), zmq.NOBLOCK)

    def close(self) -> None:
        self.ctx.destroy(linger=0)
