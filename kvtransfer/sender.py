"""Prefill side: claims rooms registered by decode and streams KV layer group by layer group.

Flow of one room::

    decode  --Register(room, session, entries)-->  bootstrap ROUTER (kept until start_room)
    prefill start_room(room)          -> claims: checks every entry's layout, --Ack-->
    prefill send_group(room, role, L, fence) -> writes those layers' pages (queued until
                                         registered; never before `fence` completed)
    prefill finish(room, first_token) -> --Complete--> once every queued write has landed
    any failure                        -> --Fail(reason)--> and the room is Failed

``on_release(room, status)`` runs exactly once, when the room has ended AND no write reading
its pages is still in flight, so the caller may then free the pages.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import msgspec
import zmq

from . import messages as m
from .config import TransferConfig
from .control import ControlLoop, ReleaseCallback
from .engine import Fence
from .layout import EntryLayout, check_compatible, group_transfers
from .state import Room, RoomStatus

log = logging.getLogger(__name__)

MAX_PENDING_REGISTRATIONS = 4096


@dataclass(frozen=True)
class Claim:
    """Decode's registration of a room, once this prefill claimed it."""

    ident: bytes  # decode's ROUTER identity: where Ack / Complete / Fail go
    reg: m.Register
    dst: dict[str, EntryLayout]  # decode's layout of each entry (its pool address)

    def dst_pages(self, role: str) -> list[int]:
        return next(e.pages for e in self.reg.entries if e.role == role)


@dataclass(kw_only=True)
class SenderRoom(Room):
    src_pages: dict[str, list[int]]  # role -> prefill's pages of the room
    claim: Claim | None = None  # set once decode's Register for the room is claimed
    queued: list[tuple] = field(default_factory=list)  # (role, layers, fence) before the claim
    outstanding: int = 0  # groups whose writes are in flight
    finish: tuple[int, dict] | None = None  # (first token, extra) once prefill finished
    tell_decode: bool = False  # send Fail to decode once the writes drained


class KVSender(ControlLoop):
    name = "kv-sender"

    def __init__(self, config: TransferConfig, layouts: dict[str, EntryLayout]):
        super().__init__(config)
        self.open_engine(layouts)
        self.router = self.socket(zmq.ROUTER)
        if config.bootstrap_port:
            self.router.bind(f"tcp://{config.host}:{config.bootstrap_port}")
            port = config.bootstrap_port
        else:
            port = self.router.bind_to_random_port(f"tcp://{config.host}")
        self.bootstrap_addr = f"{config.host}:{port}"
        self._pending: dict[int, tuple[bytes, m.Register, float]] = {}  # unclaimed registrations
        self._aborted: OrderedDict[int, str] = OrderedDict()  # aborted before start_room
        self.start()

    # ---- public API (any thread) -------------------------------------------------------------
    def start_room(
        self, room: int, src_pages: dict[str, list[int]], on_release: ReleaseCallback
    ) -> None:
        """Prefill took the request: claim the room (now, or when decode's Register arrives)."""
        for role, pages in src_pages.items():
            if role not in self.layouts:
                raise ValueError(
                    f"room {room}: no local entry {role!r} (have {list(self.layouts)})"
                )
            bad = [p for p in pages if not 0 <= p < self.layouts[role].num_pages]
            if bad:
                raise ValueError(f"room {room}: {role} pages {bad[:4]} outside the pool")
        pages = {r: list(p) for r, p in src_pages.items()}
        self.call(self._start, room, pages, on_release).result()

    def send_group(self, room: int, role: str, layers: range, fence: Fence | None = None) -> None:
        """Queue the writes of ``layers`` of entry ``role`` (non-blocking for the caller).

        ``fence``: the completion fence of the compute that wrote those layers (a CUDA event;
        None on CPU). A transfer worker waits for it before any byte of the group leaves."""
        lay = self.layouts.get(role)
        if lay is None:
            raise ValueError(f"no local entry {role!r}")
        if not (0 <= layers.start < layers.stop <= lay.num_layers and layers.step == 1):
            raise ValueError(f"layers {layers} outside [0, {lay.num_layers}) of entry {role}")
        self.call(self._send_group, room, role, layers, fence)

    def finish(self, room: int, first_token: int, extra: dict | None = None) -> None:
        """Send Complete with the aux data once all queued writes of the room have landed."""
        try:
            extra = msgspec.convert(dict(extra or {}), dict[str, m.ExtraValue])
        except msgspec.ValidationError as e:
            raise ValueError(f"room {room}: extra must map str to int/float/str/list ({e})") from e
        self.call(self._finish, room, int(first_token), extra)

    def abort(self, room: int, reason: str) -> None:
        self.call(self._fail, room, f"aborted by prefill: {reason}", True)

    def stats(self) -> dict:
        snap = super().stats()
        snap["pending_registrations"] = len(self._pending)
        return snap

    # ---- loop thread -------------------------------------------------------------------------
    def _start(self, room: int, src_pages: dict[str, list[int]], on_release) -> None:
        deadline = time.monotonic() + self.config.bootstrap_timeout_s
        r = SenderRoom(room=room, src_pages=src_pages, on_release=on_release, deadline=deadline)
        self.rooms.add(r)
        self.transfer_stats.room(room)
        aborted = self._aborted.pop(room, None)
        pending = self._pending.pop(room, None)
        if aborted is not None:
            self._fail(room, f"aborted by decode: {aborted}", False)
        elif pending is not None:
            self._claim(r, *pending[:2])

    def _check_registration(self, r: SenderRoom, reg: m.Register) -> tuple[dict, str | None]:
        """Decode's layout per entry, or the reason the registration cannot be served."""
        dst: dict[str, EntryLayout] = {}
        for entry in reg.entries:
            local = self.layouts.get(entry.role)
            if local is None:
                return dst, f"decode registered entry {entry.role!r} that prefill does not have"
            err = check_compatible(local, entry.signature)
            if err:
                return dst, err
            try:
                dst[entry.role] = EntryLayout(
                    **entry.signature, num_pages=entry.num_pages, base_addr=entry.base_addr
                )
            except (TypeError, ValueError) as e:
                return dst, f"entry {entry.role}: bad layout ({e})"
            need = len(r.src_pages.get(entry.role, ()))
            if len(entry.pages) < need:
                return (
                    dst,
                    f"entry {entry.role}: decode gave {len(entry.pages)} pages, prefill has {need}",
                )
        missing = [role for role in r.src_pages if role not in dst]
        return dst, f"decode did not register entry {missing[0]!r}" if missing else None

    def _claim(self, r: SenderRoom, ident: bytes, reg: m.Register) -> None:
        dst, err = self._check_registration(r, reg)
        r.claim = Claim(ident, reg, dst)
        if err is not None:
            self._fail(r.room, f"incompatible layout: {err}", True)
            return
        self.send(
            self.router, m.Ack(r.room, {k: v.signature() for k, v in self.layouts.items()}), ident
        )
        self.advance(r, RoomStatus.WaitingForInput)
        r.deadline = time.monotonic() + self.config.transfer_timeout_s
        queued, r.queued = r.queued, []
        for role, layers, fence in queued:
            self._launch(r, role, layers, fence)
        self._maybe_complete(r)

    def _send_group(self, room: int, role: str, layers: range, fence) -> None:
        r = self.rooms.get(room)
        if r is None and not self.rooms.ended(room):
            log.warning("kv-sender: send_group for unknown room %d ignored", room)
        if r is None or r.status.ended:
            return  # the room already ended; its release callback has run / will run
        if role not in r.src_pages:
            self._fail(room, f"send_group for entry {role!r} the room has no pages in", True)
        elif r.claim is None:
            r.queued.append((role, layers, fence))
        else:
            self._launch(r, role, layers, fence)

    def _launch(self, r: SenderRoom, role: str, layers: range, fence=None) -> None:
        src = r.src_pages[role]
        try:
            transfers = group_transfers(
                self.layouts[role],
                r.claim.dst[role],
                src,
                r.claim.dst_pages(role)[: len(src)],
                layers,
            )
        except (ValueError, IndexError) as e:
            self._fail(r.room, f"bad page table: {e}", True)
            return
        g = self.transfer_stats.group_submitted(
            r.room, role, layers, sum(t.length for t in transfers), len(transfers)
        )
        r.outstanding += 1
        self.advance(r, RoomStatus.Transferring)

        def done(ok: bool, room=r.room, g=g) -> None:  # on a transfer worker
            self.transfer_stats.group_done(g, ok)
            self.call(self._group_done, room, role, layers, ok)

        self.engine.submit(r.claim.reg.session_id, transfers, done, fence)

    def _group_done(self, room: int, role: str, layers: range, ok: bool) -> None:
        r = self.rooms.get(room)
        if r is None:
            return
        r.outstanding -= 1
        if not ok:
            where = f"{role} layers {layers.start}-{layers.stop - 1}"
            self._fail(room, f"transfer failed: {where} to {r.claim.reg.session_id}", True)
        if not r.status.ended:
            self._maybe_complete(r)
        elif r.outstanding == 0:
            self._drained(r)

    def _finish(self, room: int, first_token: int, extra: dict) -> None:
        r = self.rooms.get(room)
        if r is None or r.status.ended:
            return
        r.finish = (first_token, extra)
        self._maybe_complete(r)

    def _maybe_complete(self, r: SenderRoom) -> None:
        if r.status.ended or r.finish is None or r.claim is None:
            return
        if r.outstanding or r.queued:
            return
        first_token, extra = r.finish
        self.send(self.router, m.Complete(r.room, first_token, extra), r.claim.ident)
        self.advance(r, RoomStatus.Success)
        self.release(r)

    def _fail(self, room: int, reason: str, tell_decode: bool) -> None:
        r = self.rooms.get(room)
        if r is None or not self.advance(r, RoomStatus.Failed, reason):
            return
        r.tell_decode = tell_decode
        if r.outstanding == 0:
            self._drained(r)

    def _drained(self, r: SenderRoom) -> None:
        """A failed room has no write in flight any more: only now may decode reuse its pages,
        so the Fail goes out here (never earlier), then this side's pages are released."""
        if r.tell_decode and r.claim is not None:
            self.send(self.router, m.Fail(r.room, r.reason), r.claim.ident)
        self.release(r)

    def on_frames(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self.dropped["garbage"] = self.dropped.get("garbage", 0) + 1
            return
        ident, frame = frames
        msg = self.decode(frame)
        if msg is None:
            return
        if isinstance(msg, m.Ping):
            self.send(self.router, m.Pong(msg.seq), ident)
        elif isinstance(msg, m.Register):
            self._on_register(ident, msg)
        elif isinstance(msg, m.Abort):
            self._on_abort(ident, msg)
        else:
            log.warning("kv-sender: unexpected %s dropped", type(msg).__name__)

    def _on_abort(self, ident: bytes, msg: m.Abort) -> None:
        if self._pending.get(msg.room, (None,))[0] == ident:
            del self._pending[msg.room]
            self._aborted[msg.room] = msg.reason
            while len(self._aborted) > MAX_PENDING_REGISTRATIONS:
                self._aborted.popitem(last=False)
        r = self.rooms.get(msg.room)
        if r is not None and r.claim is not None and r.claim.ident == ident and not r.status.ended:
            # decode holds its pages until our Fail says no write is in flight any more
            self._fail(msg.room, f"aborted by decode: {msg.reason}", True)
        elif r is None or r.status.ended and r.released:
            # nothing of ours writes into that room: decode may reuse its pages now
            self.send(self.router, m.Fail(msg.room, f"room not active: {msg.reason}"), ident)

    def _on_register(self, ident: bytes, reg: m.Register) -> None:
        r = self.rooms.get(reg.room)
        if r is not None:
            if r.claim is None and not r.status.ended:
                self._claim(r, ident, reg)
            return  # duplicate registration: ignore
        ended = self.rooms.status(reg.room)
        if ended is not None:  # late registration for a room prefill already gave up
            if ended[0] == RoomStatus.Failed:
                self.send(self.router, m.Fail(reg.room, f"room already ended: {ended[1]}"), ident)
            return
        if len(self._pending) >= MAX_PENDING_REGISTRATIONS:
            log.warning("kv-sender: too many unclaimed registrations; dropping room %d", reg.room)
            return
        self._pending[reg.room] = (ident, reg, time.monotonic())

    def on_tick(self, now: float) -> None:
        ttl = self.config.bootstrap_timeout_s
        for room in [k for k, v in self._pending.items() if now - v[2] > ttl]:
            del self._pending[room]  # another prefill instance took it, or nobody did
        for r in list(self.rooms.live.values()):
            if r.status.ended or now <= r.deadline:
                continue
            if r.claim is None:
                self._fail(r.room, f"bootstrap timeout: decode did not register in {ttl:g}s", True)
            else:
                t = self.config.transfer_timeout_s
                self._fail(r.room, f"transfer timeout: room not finished {t:g}s after claim", True)
