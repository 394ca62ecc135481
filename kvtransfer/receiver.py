"""Decode side: registers destination pages with prefill and waits for the room's completion.

``register`` sends the same Register to every given prefill bootstrap address; the instance
that runs the request claims it (Ack, with its layouts, which decode checks too). Prefill then
writes straight into decode's registered buffers and finally sends Complete with the aux data.
Failure detection: no claim within ``bootstrap_timeout_s``; no completion within
``transfer_timeout_s`` after the claim; the claiming peer silent for ``heartbeat_timeout_s``
(pings every ``heartbeat_interval_s``); or a Fail from prefill. ``on_release`` runs exactly once.

Write fence: when decode gives up a room that a prefill already claimed, prefill may still have
writes in flight into the room's pages. The room then ends Failed at once, but ``on_release``
(which lets the caller reuse the pages) waits for prefill's Fail, which prefill sends only once
its writes drained, or for the peer to be lost, or for ``transfer_timeout_s``.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import zmq

from . import messages as m
from .config import TransferConfig
from .control import ControlLoop, ReleaseCallback, TransferFailed
from .layout import EntryLayout, check_compatible
from .state import Room, RoomStatus
from .stats import GroupStat

log = logging.getLogger(__name__)


class _Peer:
    __slots__ = ("addr", "sock", "last_rx", "last_ping", "seq")

    def __init__(self, addr: str, sock: zmq.Socket):
        self.addr, self.sock = addr, sock
        self.last_rx = time.monotonic()
        self.last_ping = 0.0
        self.seq = 0


@dataclass(kw_only=True)
class ReceiverRoom(Room):
    addrs: list[str]  # prefill bootstrap addresses the Register went to
    roles: list[str]  # entries decode registered pages in
    num_tokens: int
    claimed_by: str | None = None  # the prefill address that claimed the room (its Ack)
    stat: GroupStat | None = None  # transfer record, from claim to completion
    fence_until: float | None = None  # ended by decode while claimed: pages wait for prefill


class KVReceiver(ControlLoop):
    name = "kv-receiver"

    def __init__(self, config: TransferConfig, layouts: dict[str, EntryLayout]):
        super().__init__(config)
        self.open_engine(layouts)
        self.session_id = self.engine.session_id
        self._peers: dict[str, _Peer] = {}
        self._by_sock: dict[zmq.Socket, _Peer] = {}
        # room -> (first_token, extra), the last `tombstones` successes
        self._results: OrderedDict[int, tuple[int, dict]] = OrderedDict()
        self.start()

    # ---- public API (any thread) -------------------------------------------------------------
    def register(
        self,
        room: int,
        bootstrap_addrs: list[str],
        dst_pages: dict[str, list[int]],
        num_tokens: int,
        on_release: ReleaseCallback,
    ) -> None:
        if not bootstrap_addrs:
            raise ValueError(f"room {room}: no prefill bootstrap address")
        for a in bootstrap_addrs:
            host, _, port = a.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"bootstrap address {a!r} is not host:port")
        entries = []
        for role, pages in dst_pages.items():
            lay = self.layouts.get(role)
            if lay is None:
                raise ValueError(
                    f"room {room}: no local entry {role!r} (have {list(self.layouts)})"
                )
            bad = [p for p in pages if not 0 <= p < lay.num_pages]
            if bad:
                raise ValueError(f"room {room}: {role} pages {bad[:4]} outside the pool")
            entries.append(
                m.EntrySpec(role, lay.signature(), list(pages), lay.base_addr, lay.num_pages)
            )
        reg = m.Register(room, self.session_id, entries, int(num_tokens))
        self.call(self._register, reg, list(bootstrap_addrs), on_release).result()

    def result(self, room: int) -> tuple[int, dict]:
        """(first_token, extra) of a room that ended Success; raises TransferFailed otherwise."""
        with self.cond:
            r = self.rooms.get(room)
            aux = self._results.get(room)
        if aux is not None:
            return aux
        raise TransferFailed(
            room, self.failure_reason(room) or f"not finished ({r and r.status.name})"
        )

    def abort(self, room: int, reason: str) -> None:
        """Give the room up here and tell prefill (best effort)."""
        self.call(self._fail, room, f"aborted by decode: {reason}", reason)

    def forget(self, room: int) -> None:
        """Drop a finished room's aux data early (the last ``tombstones`` rooms' are kept)."""
        with self.cond:
            self._results.pop(room, None)

    # ---- loop thread -------------------------------------------------------------------------
    def _peer(self, addr: str) -> _Peer:
        p = self._peers.get(addr)
        if p is None:
            sock = self.socket(zmq.DEALER)
            sock.connect(f"tcp://{addr}")
            p = self._peers[addr] = _Peer(addr, sock)
            self._by_sock[sock] = p
        return p

    def _register(self, reg: m.Register, addrs: list[str], on_release) -> None:
        r = ReceiverRoom(
            room=reg.room,
            on_release=on_release,
            deadline=time.monotonic() + self.config.bootstrap_timeout_s,
            addrs=addrs,
            roles=[e.role for e in reg.entries],
            num_tokens=reg.num_tokens,
        )
        self.rooms.add(r)
        for a in addrs:
            self.send(self._peer(a).sock, reg)

    def _fail(
        self, room: int, reason: str, abort_reason: str | None = None, fence: bool = True
    ) -> None:
        """End the room Failed. When decode gives up a room that a prefill claimed, that prefill
        may still have writes in flight into our pages: the pages are released only when it
        answers the Abort with Fail (sent once its writes drained), when it goes silent, or after
        ``transfer_timeout_s`` (write fence)."""
        r = self.rooms.get(room)
        if r is None or not self.advance(r, RoomStatus.Failed, reason):
            return
        claimed = r.claimed_by
        if abort_reason is not None:  # tell prefill to stop writing
            for a in [claimed] if claimed else r.addrs:
                self.send(self._peer(a).sock, m.Abort(room, abort_reason))
            if claimed and fence:
                r.fence_until = time.monotonic() + self.config.transfer_timeout_s
                return
        self.release(r)

    def on_frames(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        peer = self._by_sock.get(sock)
        if peer is None or len(frames) != 1:
            self.dropped["garbage"] = self.dropped.get("garbage", 0) + 1
            return
        msg = self.decode(frames[0])
        if msg is None:
            return
        peer.last_rx = time.monotonic()
        if isinstance(msg, m.Pong):
            return
        room = getattr(msg, "room", None)
        r = self.rooms.get(room) if room is not None else None
        if r is None or peer.addr not in r.addrs:
            return  # late/duplicate message for an ended or unknown room
        claimed = r.claimed_by
        if r.status.ended:
            if r.fence_until is not None and isinstance(msg, m.Fail) and claimed == peer.addr:
                self.release(r)  # prefill's writes into the room drained: pages are ours again
            return
        if isinstance(msg, m.Ack):
            if claimed is None:
                self._on_ack(r, peer, msg)
        elif isinstance(msg, m.Fail):
            if claimed in (None, peer.addr):
                self._fail(r.room, f"prefill {peer.addr}: {msg.reason}")
        elif isinstance(msg, m.Complete):
            if claimed == peer.addr:
                with self.cond:
                    self._results[r.room] = (msg.first_token, dict(msg.extra))
                    while len(self._results) > self.config.tombstones:
                        self._results.popitem(last=False)
                self.transfer_stats.group_done(r.stat, True)
                self.advance(r, RoomStatus.Success)
                self.release(r)
        else:
            log.warning("kv-receiver: unexpected %s dropped", type(msg).__name__)

    def _on_ack(self, r: ReceiverRoom, peer: _Peer, ack: m.Ack) -> None:
        r.claimed_by = peer.addr
        for role in r.roles:
            sig = ack.signatures.get(role)
            lay = self.layouts[role]
            err = f"prefill has no {role} entry" if sig is None else check_compatible(lay, sig)
            if err:
                self._fail(r.room, f"incompatible layout: {err}", f"incompatible layout: {err}")
                return
        self.advance(r, RoomStatus.WaitingForInput)
        r.deadline = time.monotonic() + self.config.transfer_timeout_s
        nbytes = 0  # what prefill will write: the prompt's pages of every entry
        for role in r.roles:
            lay = self.layouts[role]
            pages = -(-r.num_tokens // lay.page_size)
            nbytes += pages * lay.page_bytes * lay.components * lay.num_layers
        layers = range(0, max(self.layouts[x].num_layers for x in r.roles))
        r.stat = self.transfer_stats.group_submitted(r.room, "all", layers, nbytes, 0)

    def on_tick(self, now: float) -> None:
        cfg = self.config
        active: set[str] = set()
        for r in list(self.rooms.live.values()):
            claimed = r.claimed_by
            if r.status.ended:  # fenced: waiting for prefill's writes to drain
                silent = now - self._peers[claimed].last_rx > cfg.heartbeat_timeout_s
                if r.fence_until is not None and (silent or now > r.fence_until):
                    log.warning("kv-receiver: room %d released without drain notice", r.room)
                    self.release(r)
                continue
            if now > r.deadline:
                if claimed is None:
                    t = cfg.bootstrap_timeout_s
                    why = f"bootstrap timeout: no prefill claimed the room in {t:g}s"
                    self._fail(r.room, f"{why} (asked {', '.join(r.addrs)})", "bootstrap timeout")
                else:
                    why = f"transfer timeout: no completion {cfg.transfer_timeout_s:g}s after claim"
                    self._fail(r.room, why, "decode transfer timeout")
                continue
            if claimed is not None:
                peer = self._peers[claimed]
                if now - peer.last_rx > cfg.heartbeat_timeout_s:
                    self._fail(
                        r.room,
                        f"prefill peer lost: {claimed} silent for {now - peer.last_rx:.1f}s",
                        "peer lost",
                        fence=False,
                    )
                    continue
                active.add(claimed)
        for addr in active:
            p = self._peers[addr]
            if now - p.last_ping >= cfg.heartbeat_interval_s:
                p.last_ping, p.seq = now, p.seq + 1
                self.send(p.sock, m.Ping(p.seq))
