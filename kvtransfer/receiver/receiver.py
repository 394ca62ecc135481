"""Decode side: registers destination pages with prefill and waits for the room's completion.

``register`` sends a Register (exactly the prompt's pages of each entry) to the given prefill
bootstrap address(es); the instance that runs the request claims it (Ack, with its layouts,
which decode checks too). Prefill then writes straight into decode's registered buffers and
finally sends Complete with the aux data. Failure detection: no claim within
``bootstrap_timeout_s``; no completion within ``queue_timeout_s + transfer_timeout_s`` after the
claim (prefill computes a registered room when its turn comes); the claiming peer silent for
``heartbeat_timeout_s`` (pings every ``heartbeat_interval_s``); or a Fail from prefill.
Silence is counted in pings that went out unanswered, not in time alone: when this side's own
loop stalls (a loaded host, a long call holding the GIL), it sent no pings, so the peer had
nothing to answer and is not blamed for it.

Quarantine (write fence): when a room ends Failed while a prefill may still write into its
pages, ``on_release`` (which lets the caller reuse the pages) waits until each such prefill has
either answered the Abort with Fail (prefill sends it only once its writes drained) or is proven
gone: its control connection closed after the Register went out (zmq socket monitor). Silence
alone never releases pages. A peer that never connected cannot have received the Register:
its socket is closed (dropping the queued Register) once no other live room uses it.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import zmq
from zmq.utils.monitor import parse_monitor_message

from ..config import TransferConfig
from ..control.loop import ControlLoop, ReleaseCallback, TransferFailed
from ..control.state import ReceiverRoom, RoomStatus
from ..link.proof import SessionToken
from ..memory.layout import EntryLayout, check_compatible
from ..protocol import messages as m
from ..protocol.checksum import verify_room
from ..protocol.identity import INCOMPATIBLE, reason_of
from .hints import hint_failure
from .staging import ReceiveLinks, StagedReceives

log = logging.getLogger(__name__)

_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


class _Peer:
    """One prefill bootstrap endpoint: a DEALER socket plus its connection state."""

    __slots__ = (
        "addr",
        "sock",
        "mon",
        "last_rx",
        "last_ping",
        "unanswered",
        "seq",
        "connected",
        "epoch",
    )

    def __init__(self, addr: str, sock: zmq.Socket, mon: zmq.Socket):
        self.addr, self.sock, self.mon = addr, sock, mon
        self.last_rx = time.monotonic()
        self.last_ping = 0.0
        self.unanswered = 0  # pings sent since the peer's last message
        self.seq = 0
        self.connected = False
        self.epoch = 0  # connections made so far; a disconnect after a Register proves its
        # receiver (that prefill process) can no longer write


def check_address(addr: str) -> str:
    """``host:port`` with a concrete host and a port in 1..65535, else ValueError."""
    host, sep, port = addr.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"bootstrap address {addr!r} is not host:port")
    if host in ("*", "0.0.0.0", "::") or any(c.isspace() for c in host):
        raise ValueError(f"bootstrap address {addr!r} names no single host")
    return addr


class KVReceiver(ControlLoop):
    """``tensors`` (role -> the pool's tensor, optional): enables staged transfers (decode
    scatters chunks that prefill gathered from fragmented page tables)."""

    name = "kv-receiver"

    def __init__(
        self,
        config: TransferConfig,
        layouts: dict[str, EntryLayout],
        tensors: dict | None = None,
        agents: list | None = None,
    ):
        super().__init__(config, layouts, tensors)  # faults flip=P: corrupt landed KV
        self.staging = StagedReceives(
            config,
            self.layouts,
            self.open_staging(tensors, config.staging_recv_slots),
            list(agents or []),  # a TP decode's ranks 1..N-1
            self.rooms,
            ReceiveLinks(
                grant=self._grant,
                post=self.call,
                fail=lambda room, reason: self._fail(room, reason, reason),
                drained=self._scatters_drained,
            ),
        )
        self.session_id = self.engine.session_id
        self.token = SessionToken(self.engine)  # proves to prefill that we own this session
        self._peers: dict[str, _Peer] = {}
        self._by_sock: dict[zmq.Socket, _Peer] = {}
        self._by_mon: dict[zmq.Socket, _Peer] = {}
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
        on_fail=None,
        on_first=None,
        first: dict[str, int] | None = None,
    ) -> None:
        """Register the prompt's pages of every entry (``dst_pages``: role -> page ids of the
        blocks from ``first[role]`` on, default 0: every block, or those a sliding window
        reaches, or the one state slot; the blocks before ``first`` decode already holds, so
        prefill sends none of them). ``on_fail(room, reason)`` runs as soon as the room fails;
        ``on_release(room, status)`` when its pages may be reused (later, while they are
        quarantined); ``on_first(room, token)`` when prefill sent the first token (before the KV
        landed). All on the control thread."""
        if not bootstrap_addrs:
            raise ValueError(f"room {room}: no prefill bootstrap address")
        addrs = [check_address(a) for a in bootstrap_addrs]
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
            block = (first or {}).get(role, 0)
            sig = lay.signature()
            entries.append(m.EntrySpec(role, sig, list(pages), lay.base_addr, lay.num_pages, block))
        reg = m.Register(
            room,
            self.session_id,
            entries,
            int(num_tokens),
            self.token.addr,
            self.token.token,
            **self.staging.register_fields(),
            fingerprint=self.fingerprint,
            ranks=self.staging.rank_dests(),
        )
        self.call_sync(self._register, reg, addrs, on_release, on_fail, on_first)

    def refuse(self, room: int, bootstrap_addrs: list[str], reason: str) -> None:
        """Tell prefill this room will never be registered (decode refused the request), so it
        drops it now instead of after its queue timeout. Best effort, no room is created."""
        addrs = [check_address(a) for a in bootstrap_addrs]
        self.call(self._refuse, room, addrs, reason)

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
        """Give the room up here and tell prefill (best effort); pages wait in quarantine."""
        self.call(self._fail, room, f"aborted by decode: {reason}", reason)

    def forget(self, room: int) -> None:
        """Drop a finished room's aux data early (the last ``tombstones`` rooms' are kept)."""
        with self.cond:
            self._results.pop(room, None)

    def quarantined(self) -> set[int]:
        """Rooms that ended but whose pages wait for a prefill's drain or disconnection."""
        with self.cond:
            return {r.room for r in self.rooms.live.values() if r.status.ended}

    # ---- loop thread -------------------------------------------------------------------------
    def _peer(self, addr: str) -> _Peer:
        p = self._peers.get(addr)
        if p is None:
            sock = self.socket(zmq.DEALER)
            mon = sock.get_monitor_socket(_EVENTS)
            try:
                sock.connect(f"tcp://{addr}")
            except zmq.ZMQError as e:
                self._close_peer_sockets(sock, mon)
                raise ValueError(f"bootstrap address {addr!r}: {e}") from None
            self.poller.register(mon, zmq.POLLIN)
            p = self._peers[addr] = _Peer(addr, sock, mon)
            self._by_sock[sock] = p
            self._by_mon[mon] = p
        return p

    def _close_peer_sockets(self, sock: zmq.Socket, mon: zmq.Socket) -> None:
        for s in (sock, mon):
            try:
                self.poller.unregister(s)
            except KeyError:
                pass
        sock.disable_monitor()
        mon.close(linger=0)
        sock.close(linger=0)

    def _register(self, reg: m.Register, addrs: list[str], on_release, on_fail, on_first) -> None:
        peers = [self._peer(a) for a in addrs]  # a bad address fails here, before any room
        r = ReceiverRoom(
            room=reg.room,
            on_release=on_release,
            on_fail=on_fail,
            on_first=on_first,
            deadline=time.monotonic() + self.config.bootstrap_timeout_s,
            addrs=addrs,
            roles=[e.role for e in reg.entries],
            pages={e.role: list(e.pages) for e in reg.entries},
            num_tokens=reg.num_tokens,
            # the connection that carries the Register: the current one, or the next
            epochs={p.addr: p.epoch if p.connected else p.epoch + 1 for p in peers},
        )
        self.rooms.add(r)  # KeyError for a room id in use: nothing was sent
        for p in peers:
            self.send(p.sock, reg)

    def _refuse(self, room: int, addrs: list[str], reason: str) -> None:
        for a in addrs:
            self.send(self._peer(a).sock, m.Abort(room, f"decode refused the request: {reason}"))

    def _fail(
        self, room: int, reason: str, abort_reason: str | None = None, drained: tuple = ()
    ) -> None:
        """End the room Failed. Its pages are released at once only if no prefill can write
        into them (``drained``: peers that said so); else they wait in quarantine."""
        r = self.rooms.get(room)
        if r is None or not self.advance(r, RoomStatus.Failed, reason):
            return
        if r.on_fail is not None:
            try:
                r.on_fail(room, r.reason)
            except Exception:
                log.exception("kv-receiver: on_fail of room %d raised", room)
        writers = ({r.claimed_by} if r.claimed_by else set(r.addrs)) - set(drained)
        for a in writers if abort_reason is not None else ():  # tell prefill to stop writing
            p = self._peers.get(a)
            if p is not None:
                self.send(p.sock, m.Abort(room, abort_reason))
        r.quarantine = writers
        self._try_release(r)

    def _try_release(self, r: ReceiverRoom) -> None:
        """Release the pages of an ended room once no awaited prefill can still write and no
        rank's scatter of it is in flight."""
        for addr in list(r.quarantine or ()):
            p, carry = self._peers.get(addr), r.epochs.get(addr, 0)
            if p is None or p.epoch > carry or (p.epoch == carry and not p.connected):
                r.quarantine.discard(addr)  # the connection that carried the Register closed
            elif p.epoch < carry and not self._peer_in_use(p, r):
                self._reset_peer(p)  # the Register never left this process: drop it
                r.quarantine.discard(addr)
        if not r.quarantine and not self.staging.scattering(r.room):
            self.release(r)

    def _peer_in_use(self, p: _Peer, but: ReceiverRoom) -> bool:
        return any(
            p.addr in x.addrs and x is not but and not x.status.ended
            for x in self.rooms.live.values()
        )

    def _reset_peer(self, p: _Peer) -> None:
        del self._peers[p.addr], self._by_sock[p.sock], self._by_mon[p.mon]
        self._close_peer_sockets(p.sock, p.mon)

    def on_frames(self, sock: zmq.Socket, frames: list[zmq.Frame]) -> None:
        mon_peer = self._by_mon.get(sock)
        if mon_peer is not None:
            self._on_monitor(mon_peer, [f.bytes for f in frames])
            return
        peer = self._by_sock.get(sock)
        if peer is None or len(frames) != 1:
            self.drop("garbage", f"{len(frames)} frames")
            return
        msg = self._decode_or_hint(peer, frames[0].bytes)
        if msg is None:
            return
        peer.last_rx, peer.unanswered = time.monotonic(), 0
        if isinstance(msg, m.Pong):
            return
        room = getattr(msg, "room", None)
        r = self.rooms.get(room) if room is not None else None
        if r is None or peer.addr not in r.addrs:
            return  # late/duplicate message for an ended or unknown room
        if r.status.ended:
            if isinstance(msg, m.Fail) and r.quarantine and peer.addr in r.quarantine:
                r.quarantine.discard(peer.addr)  # that prefill's writes into the room drained
                self._try_release(r)
            return
        self._on_message(r, peer, msg)

    def _on_message(self, r: ReceiverRoom, peer: _Peer, msg: m.Message) -> None:
        claimed = r.claimed_by
        if isinstance(msg, m.Ack):
            if claimed is None:
                self._on_ack(r, peer, msg)
        elif isinstance(msg, m.Fail):
            if INCOMPATIBLE in msg.reason and claimed is None:
                self.count_refusal(reason_of(msg.reason), f"room {r.room}: {msg.reason}")
            if claimed in (None, peer.addr):  # that prefill's writes (if any) drained
                other = None if claimed else "another prefill failed the room"
                self._fail(r.room, f"prefill {peer.addr}: {msg.reason}", other, (peer.addr,))
        elif isinstance(msg, m.Complete):
            if claimed == peer.addr and r.complete is None:
                r.complete = msg
                if not self.staging.scattering(r.room):  # else once the ranks scattered
                    self._complete(r)
        elif isinstance(msg, m.FirstToken) and claimed == peer.addr:
            if r.on_first is not None and msg.token >= 0:
                try:
                    r.on_first(r.room, msg.token)
                except Exception:
                    log.exception("kv-receiver: on_first of room %d raised", r.room)
        elif isinstance(msg, m.Want) and claimed == peer.addr:
            dropped = self.staging.on_want(r, msg)
            if dropped:
                self.drop("unexpected", dropped)
        elif isinstance(msg, m.Staged) and claimed == peer.addr:
            err = self.staging.on_staged(r, msg)
            if err:
                self._fail(r.room, f"bad staged chunk: {err}", f"bad staged chunk: {err}")
        else:
            self.drop("unexpected", type(msg).__name__)

    def release(self, r: ReceiverRoom) -> None:
        super().release(r)
        if r.released:
            self.staging.release(r.room)

    def _complete(self, r: ReceiverRoom) -> None:
        """Prefill's writes all landed and every chunk was scattered: the room succeeds."""
        msg = r.complete
        bad = self._checksum_error(r, msg)
        if bad:  # prefill's writes are done (Complete): no quarantine needed
            self._fail(r.room, bad, None, (r.claimed_by,))
            return
        with self.cond:
            self._results[r.room] = (msg.first_token, dict(msg.extra))
            while len(self._results) > self.config.tombstones:
                self._results.popitem(last=False)
        self.transfer_stats.group_done(r.stat, True)
        self.advance(r, RoomStatus.Success)
        self.release(r)

    def _scatters_drained(self, room: int) -> None:
        """The room's last rank scatter in flight was answered: a deferred Complete or a
        release that waited for it goes on."""
        r = self.rooms.get(room)
        if r is None:
            return
        if r.status.ended:
            self._try_release(r)
        elif r.complete is not None:
            self._complete(r)

    def _grant(self, r: ReceiverRoom, rank: int, slot: int) -> None:
        self.send(self._peers[r.claimed_by].sock, m.Grant(r.room, slot, rank))

    def _checksum_error(self, r: ReceiverRoom, msg: m.Complete) -> str | None:
        """With ``kv_checksum``: the error when the landed KV of any entry differs from what
        prefill summed (or prefill sent no checksums), else None."""
        if not self.config.kv_checksum:
            return None
        pages = {role: r.pages[role] for role in r.roles}
        flips = self.faults.flips(r.room)
        return verify_room(self.layouts, self.pool_tensors, pages, msg.checksums, flips)

    def _decode_or_hint(self, peer: _Peer, raw: bytes) -> m.Message | None:
        """A verified message, else None; a Refuse (unsigned: it fails verification, unless
        this side has no secret) goes to :meth:`_on_refuse_hint` either way."""
        try:
            msg = self.verifier.decode(raw)
        except m.MessageError as e:
            self.drop(e.kind, e)
            hint = m.peek_refusal(raw) if e.kind in ("auth", "version") else None
            if hint is not None:
                self._on_refuse_hint(peer, hint)
            return None
        if isinstance(msg, m.Refuse):
            self._on_refuse_hint(peer, msg)
            return None
        return msg

    def _on_refuse_hint(self, peer: _Peer, hint: m.Refuse) -> None:
        """Prefill could not verify or read this room's Register (:mod:`.hints`): end the room
        early; its pages stay quarantined for at most ``transfer_timeout_s``."""
        r = self.rooms.get(hint.room)
        why = hint_failure(r, peer.addr, hint, self.fingerprint and self.fingerprint.key_id)
        if why is None:
            return
        self.count_refusal(reason_of(why), f"room {r.room}: prefill {peer.addr}: {why}")
        self._fail(r.room, f"prefill {peer.addr}: {why}")
        if r.quarantine and not r.released:
            r.quarantine_until = time.monotonic() + self.config.transfer_timeout_s

    def _on_monitor(self, peer: _Peer, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)["event"]
        if event == zmq.EVENT_CONNECTED:
            peer.connected, peer.epoch = True, peer.epoch + 1
            peer.last_rx, peer.unanswered = time.monotonic(), 0
        elif event == zmq.EVENT_DISCONNECTED:
            peer.connected = False
            for r in [x for x in self.rooms.live.values() if x.status.ended and x.quarantine]:
                self._try_release(r)

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
        cfg = self.config
        r.deadline = time.monotonic() + cfg.queue_timeout_s + cfg.transfer_timeout_s
        nbytes = 0  # what prefill will write: the prompt's pages of every entry
        for role in r.roles:
            lay = self.layouts[role]
            nbytes += len(r.pages[role]) * lay.page_bytes * lay.components * lay.num_layers
        layers = range(0, max(self.layouts[x].num_layers for x in r.roles))
        r.stat = self.transfer_stats.group_submitted(r.room, "all", layers, nbytes, 0)

    def on_tick(self, now: float) -> None:
        active: set[str] = set()
        for r in list(self.rooms.live.values()):
            try:
                if not r.status.ended:
                    self._tick_room(r, now, active)
                elif r.quarantine and r.quarantine_until and now > r.quarantine_until:
                    r.quarantine.clear()  # only a Refuse hint's room: see _on_refuse_hint
                    self._try_release(r)
            except Exception:  # one room's trouble never stops the others' timeouts
                self.loop_errors += 1
                log.exception("kv-receiver: tick of room %d failed", r.room)
        for addr in active:
            p = self._peers[addr]
            if now - p.last_ping >= self.config.heartbeat_interval_s:
                p.last_ping, p.seq, p.unanswered = now, p.seq + 1, p.unanswered + 1
                self.send(p.sock, m.Ping(p.seq))

    def _lost(self, peer: _Peer, now: float) -> bool:
        """Silent for ``heartbeat_timeout_s`` while ``heartbeat_misses`` pings went unanswered."""
        cfg = self.config
        return (
            now - peer.last_rx > cfg.heartbeat_timeout_s and peer.unanswered >= cfg.heartbeat_misses
        )

    def _tick_room(self, r: ReceiverRoom, now: float, active: set[str]) -> None:
        cfg, claimed = self.config, r.claimed_by
        if now > r.deadline:
            if claimed is None:
                t = cfg.bootstrap_timeout_s
                why = f"bootstrap timeout: no prefill claimed the room in {t:g}s"
                self._fail(r.room, f"{why} (asked {', '.join(r.addrs)})", "bootstrap timeout")
            else:
                t = cfg.queue_timeout_s + cfg.transfer_timeout_s
                self._fail(r.room, f"transfer timeout: no completion {t:g}s after claim", "timeout")
            return
        if claimed is not None:
            peer = self._peers[claimed]
            if self._lost(peer, now):
                silent, n = now - peer.last_rx, peer.unanswered
                why = f"prefill peer lost: {claimed} silent for {silent:.1f}s, {n} pings unanswered"
                self._fail(r.room, why, "peer lost")
                return
            active.add(claimed)
