"""Client-cancel side channel: postprocess -> decode, one tiny typed message per cancelled room.

Why: Triton ensembles cancel only the steps they schedule AFTER the client cancelled, never the
step already running. Decode's request is running for the whole generation, so it never sees
``is_cancelled()``; the next postprocess step (scheduled per decode response) does. Postprocess
then tells the decode instance (its address travels with every decode response) to stop.

Wire format (no pickle): ``MAGIC (4 bytes) | version (1) | room (int64, big endian)``, followed by
an HMAC-SHA256 of those 13 bytes when a shared secret is configured. Bad frames are dropped.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import struct
import threading
from collections.abc import Callable

import zmq

log = logging.getLogger(__name__)

MAGIC = b"PDCX"
VERSION = 1  # v1: room only
_FMT = ">4sBq"
_SIZE = struct.calcsize(_FMT)


def encode(room: int, secret: bytes | None = None) -> bytes:
    body = struct.pack(_FMT, MAGIC, VERSION, room)
    return body + (hmac.new(secret, body, hashlib.sha256).digest() if secret else b"")


def decode(frame: bytes, secret: bytes | None = None) -> int | None:
    """The room of a valid frame, else None."""
    want = _SIZE + (32 if secret else 0)
    if len(frame) != want:
        return None
    body = frame[:_SIZE]
    magic, version, room = struct.unpack(_FMT, body)
    if magic != MAGIC or version != VERSION:
        return None
    if secret and not hmac.compare_digest(
        frame[_SIZE:], hmac.new(secret, body, hashlib.sha256).digest()
    ):
        return None
    return room


class CancelListener:
    """PULL socket on ``host`` (random port); calls ``on_cancel(room)`` on its own thread."""

    def __init__(self, host: str, on_cancel: Callable[[int], None], secret: bytes | None = None):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.addr = f"{host}:{port}"
        self.on_cancel, self.secret = on_cancel, secret
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="cancel-listener", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            if not self.sock.poll(200):
                continue
            room = decode(self.sock.recv(), self.secret)
            if room is None:
                log.warning("cancel channel: dropped a malformed or unsigned frame")
                continue
            try:
                self.on_cancel(room)
            except Exception:
                log.exception("cancel channel: on_cancel(%d) failed", room)

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
            sock.send(encode(room, self.secret), zmq.NOBLOCK)

    def close(self) -> None:
        self.ctx.destroy(linger=0)
