"""A prefill that speaks the signed control protocol by hand: a zmq ROUTER on loopback that a
real KVReceiver registers with, so a test can answer (or not) message by message."""

from __future__ import annotations

import time

import zmq

from kvtransfer import TransferConfig
from kvtransfer import messages as m


def receiver_config(secret: bytes, slot_bytes: int, slots: int, grants: int) -> TransferConfig:
    """A decode side with ``slots`` staging slots of ``slot_bytes``, ``grants`` lent a room; it
    never times the scripted peer out for silence (the peer does not answer pings)."""
    return TransferConfig(
        shared_secret=secret,
        staging_slot_bytes=slot_bytes,
        staging_recv_slots=slots,
        staging_grants_per_room=grants,
        heartbeat_interval_s=60.0,
    )


class ScriptedPrefill:
    def __init__(self, secret: bytes):
        self.secret = secret
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.addr = f"127.0.0.1:{port}"

    def recv(self, kind, timeout: float = 10.0):
        """(decode's identity, the next message of type ``kind``); others are skipped."""
        end = time.time() + timeout
        while time.time() < end:
            if self.router.poll(200):
                ident, frame = self.router.recv_multipart()
                msg = m.decode(frame, self.secret)
                if isinstance(msg, kind):
                    return ident, msg
        raise AssertionError(f"no {kind.__name__} from decode")

    def send(self, ident: bytes, msg: m.Message) -> None:
        self.router.send_multipart([ident, m.encode(msg, self.secret)])

    def close(self) -> None:
        self.ctx.destroy(linger=0)
