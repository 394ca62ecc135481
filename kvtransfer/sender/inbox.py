"""Prefill's handling of decode's control messages: Ping, Register, Abort, Grant (run on the
sender's control thread).

The :class:`Inbox` owns every registration no room has claimed yet: the ones held until their
connection proved it owns the Mooncake session it names (:mod:`kvtransfer.link.proof`; at most
``max_pending_per_peer`` a connection), the ones waiting for the stage to queue their room, and
the rooms that ended before the stage queued them. A Register that fails a check is refused to
that connection only: a hostile or broken peer can fail only its own registrations, never
another peer's room.

Deployment identity (protocol 5): a Register whose fingerprint differs from prefill's is refused
at once with a signed ``Fail`` "incompatible deployment: <field> differs ...". A Register frame
that does not verify (another secret) or is of another protocol version cannot be trusted, so
it is answered with an UNSIGNED ``Refuse`` that carries only this side's key id, protocol and the
reason, to that connection only, at most ``REFUSE_PER_S`` a second (decode takes it as a hint).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from ..control.state import RoomStatus, RoomTable, SenderRoom
from ..link.engine import Engine
from ..link.proof import ProofChecker
from ..memory.layout import EntryLayout
from ..protocol import messages as m
from ..protocol.identity import INCOMPATIBLE, Fingerprint, refusal
from .registration import PeerBook, RegistrationError, check_entries, proofs

MAX_PENDING_REGISTRATIONS = 4096
REFUSE_PER_S = 100  # unsigned Refuse answers, all connections together


@dataclass(frozen=True)
class InboxLinks:
    """What the inbox does to the rest of the sender (all on the control thread)."""

    reply: Callable[[bytes, m.Message, bool], None]  # to one connection; signed or not
    drop: Callable[[str, object], None]  # count (and rarely log) a dropped frame, by kind
    refused: Callable[[str, str], None]  # count (and rarely log) a deployment refusal
    post: Callable  # run ``fn(*args)`` on the control thread later (from any thread)
    claim: Callable[[SenderRoom, bytes, m.Register], None]  # pair the room with a Register
    fail: Callable[[int, str, bool], None]  # fail a room; tell decode or not
    grant: Callable[[bytes, m.Grant], None]  # a staging slot decode lent


class Inbox:
    def __init__(
        self,
        layouts: dict[str, EntryLayout],
        engine: Engine,
        verifier: m.Verifier,
        fingerprint: Fingerprint | None,
        rooms: RoomTable,
        max_pending_per_peer: int,
        links: InboxLinks,
    ):
        self.layouts, self.verifier, self.fingerprint = layouts, verifier, fingerprint
        self.rooms, self.links = rooms, links
        self.peers = PeerBook(max_pending_per_peer)
        self.proofs = ProofChecker(engine)
        self._pending: dict[int, tuple[bytes, m.Register, float]] = {}  # unclaimed registrations
        # rooms decode aborted, or whose registration was refused, before the stage took them:
        # room -> the reason the room fails with when it is expected / started
        self._ended_early: OrderedDict[int, str] = OrderedDict()
        self._refuse_window, self._refuse_sent = 0.0, 0  # unsigned Refuse rate limit (1 s)

    # ---- what the sender asks ----------------------------------------------------------------
    def take(self, room: int) -> tuple[str | None, tuple[bytes, m.Register] | None]:
        """The stage queued ``room``: (the reason it already ended, or None; the registration
        waiting for it, or None). Either is forgotten here."""
        ended = self._ended_early.pop(room, None)
        pending = self._pending.pop(room, None)
        if pending is not None:
            self.peers.remove_pending(pending[0])
        return ended, (pending[:2] if pending is not None else None)

    def end_early(self, room: int, reason: str) -> None:
        """``room`` ended before the stage queued it: it fails with ``reason`` when it is."""
        self._ended_early[room] = reason
        while len(self._ended_early) > MAX_PENDING_REGISTRATIONS:
            self._ended_early.popitem(last=False)

    def expire(self, now: float, ttl: float) -> None:
        """Forget registrations that no room here took within ``ttl`` seconds."""
        for room in [k for k, v in self._pending.items() if now - v[2] > ttl]:
            self.peers.remove_pending(self._pending.pop(room)[0])

    @property
    def pending(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        self.proofs.close()

    # ---- frames ------------------------------------------------------------------------------
    def on_frames(self, frames: list[zmq.Frame]) -> None:
        if len(frames) != 2:
            self.links.drop("garbage", f"{len(frames)} frames")
            return
        ident, raw = frames[0].bytes, frames[1].bytes
        try:
            msg = self.verifier.decode(raw)
        except m.MessageError as e:
            self.links.drop(e.kind, e)
            if e.kind in ("auth", "version"):
                self._refuse_unverified(ident, raw, e.kind)
            return
        if isinstance(msg, m.Ping):
            self.links.reply(ident, m.Pong(msg.seq), True)
        elif isinstance(msg, m.Register):
            self._on_register(ident, _peer_address(frames[1]), msg)
        elif isinstance(msg, m.Abort):
            self._on_abort(ident, msg)
        elif isinstance(msg, m.Grant):
            self.links.grant(ident, msg)
        else:
            self.links.drop("unexpected", type(msg).__name__)

    def _refuse_registration(self, ident: bytes, reg: m.Register, why: str) -> None:
        self.links.drop("hostile", f"room {reg.room}: {why}")
        self.links.reply(ident, m.Fail(reg.room, f"registration refused: {why}"), True)

    def _refuse_unverified(self, ident: bytes, raw: bytes, kind: str) -> None:
        """Answer a Register we cannot verify or read with an unsigned Refuse (a hint)."""
        got = m.peek_register(raw)
        now = time.monotonic()
        if got is None:
            return
        if now - self._refuse_window >= 1.0:
            self._refuse_window, self._refuse_sent = now, 0
        if self._refuse_sent >= REFUSE_PER_S:
            return
        self._refuse_sent += 1
        version, room = got
        fp = self.fingerprint
        if kind == "version":
            label = "protocol"
            why = f"protocol {m.PROTOCOL_VERSION} vs {version} (prefill vs decode)"
        else:
            label = "secret"
            why = (
                f"secret differs (prefill key id {fp.key_id if fp else '?'}): this prefill cannot"
                " verify decode's signed messages; give every server the same --secret-file"
            )
        msg = f"{INCOMPATIBLE}: {why}"
        self.links.refused(label, f"refused room {room}: {msg}")
        refuse = m.Refuse(room, msg, fp.key_id if fp else "", m.PROTOCOL_VERSION)
        self.links.reply(ident, refuse, False)

    def _refuse_incompatible(self, ident: bytes, reg: m.Register) -> bool:
        """Refuse (signed Fail) a Register whose deployment fingerprint differs from ours."""
        if self.fingerprint is None or reg.fingerprint is None:
            return False
        got = refusal(self.fingerprint, reg.fingerprint)
        if got is None:
            return False
        label, msg = got
        self.links.refused(label, f"refused room {reg.room}: {msg}")
        if not self._registered_by_other(ident, reg.room):  # another peer's room stays theirs
            r = self.rooms.get(reg.room)
            if r is not None and r.claim is None and not r.status.ended:
                self.links.fail(reg.room, msg, False)
            elif r is None and not self.rooms.ended(reg.room):
                self.end_early(reg.room, msg)
        if label == "secret":  # decode cannot verify what we sign: the unsigned hint
            fp = self.fingerprint
            self.links.reply(ident, m.Refuse(reg.room, msg, fp.key_id, fp.protocol), False)
        else:
            self.links.reply(ident, m.Fail(reg.room, msg), True)
        return True

    def _on_register(self, ident: bytes, peer_address: str | None, reg: m.Register) -> None:
        if self._refuse_incompatible(ident, reg):
            return
        try:
            self.peers.check(ident, peer_address, reg)
        except RegistrationError as e:
            self._refuse_registration(ident, reg, str(e))
            return
        peer = self.peers.peer(ident)
        if peer.refused:
            self._refuse_registration(ident, reg, peer.refused)
        elif peer.session is None:  # not proven yet: hold it, prove once per connection
            if len(peer.held) >= self.peers.max_pending:
                self._refuse_registration(ident, reg, "too many registrations before the proof")
                return
            peer.held.append(reg)
            if not peer.proving:
                peer.proving = True
                todo = proofs(reg)  # every decode rank's session (tensor parallel: several)
                peer.proofs_left = len(todo)
                for session, addr, token in todo:
                    if not self.proofs.check(ident, session, addr, token, self._proof_verdict):
                        self._proven(ident, False, "too many session proofs under way")
                        return
        else:
            self._serve_register(ident, reg)

    def _proof_verdict(self, ident: bytes, ok: bool, why: str) -> None:  # a proof thread
        self.links.post(self._one_proof, ident, ok, why)

    def _one_proof(self, ident: bytes, ok: bool, why: str) -> None:
        peer = self.peers.peer(ident)
        if not peer.proving:
            return  # already decided (another session's proof failed)
        peer.proofs_left -= 1
        if not ok or peer.proofs_left <= 0:
            self._proven(ident, ok, why)

    def _proven(self, ident: bytes, ok: bool, why: str) -> None:
        peer = self.peers.peer(ident)
        held, peer.held, peer.proving = peer.held, [], False
        if ok:
            self.peers.bind(ident, held[0])
        else:
            peer.refused = why
        for reg in held:
            try:
                if not ok:
                    raise RegistrationError(why)
                self.peers.check(ident, None, reg)  # the same session as the proven one
            except RegistrationError as e:
                self._refuse_registration(ident, reg, str(e))
                continue
            self._serve_register(ident, reg)

    def _serve_register(self, ident: bytes, reg: m.Register) -> None:
        r = self.rooms.get(reg.room)
        if r is not None:
            if r.claim is None and not r.status.ended:
                self.links.claim(r, ident, reg)
            elif r.claim is not None and r.claim.ident != ident:
                self.links.drop(
                    "conflict", f"room {reg.room} is already registered by another peer"
                )
            return  # a duplicate of the registration we have: ignore
        ended = self.rooms.status(reg.room)
        if ended is not None:  # late registration for a room prefill already gave up
            if ended[0] == RoomStatus.Failed:
                self.links.reply(ident, m.Fail(reg.room, f"room already ended: {ended[1]}"), True)
            return
        early = self._ended_early.get(reg.room)
        if early is not None:  # ended before the stage queued it (an Abort, a refused entry)
            self.links.reply(ident, m.Fail(reg.room, f"room already ended: {early}"), True)
            return
        self._keep_pending(ident, reg)

    def _keep_pending(self, ident: bytes, reg: m.Register) -> None:
        have = self._pending.get(reg.room)
        if have is not None:  # the first registration of a room wins; a repeat is ignored
            if have[0] != ident:
                self.links.drop(
                    "conflict", f"room {reg.room} is already registered by another peer"
                )
            return
        try:
            check_entries(reg, self.layouts)  # refuse what can never be served, at once
        except RegistrationError as e:
            self.end_early(reg.room, str(e))
            self.links.reply(ident, m.Fail(reg.room, str(e)), True)
            return
        if len(self._pending) >= MAX_PENDING_REGISTRATIONS or not self.peers.add_pending(ident):
            self.links.drop("flood", f"too many unclaimed registrations; room {reg.room} refused")
            self.links.reply(
                ident, m.Fail(reg.room, "registration refused: too many pending"), True
            )
            return
        self._pending[reg.room] = (ident, reg, time.monotonic())

    def _on_abort(self, ident: bytes, msg: m.Abort) -> None:
        """An Abort ends a room that this connection registered (its claim, its pending or held
        registration) or that nobody registered yet (a decode that refused the request before
        registering says so this way). A room another connection registered is left alone: the
        sender only hears that nothing of ours writes into its pages for that room (true: it
        has no claim), so one peer can never end another peer's room."""
        if self._registered_by_other(ident, msg.room):
            self.links.drop("hostile", f"room {msg.room}: abort by a peer that does not own it")
            self.links.reply(ident, m.Fail(msg.room, f"room not active: {msg.reason}"), True)
            return
        self._drop_registration(ident, msg.room)
        r = self.rooms.get(msg.room)
        if r is not None and r.claim is not None and not r.status.ended:
            # decode holds its pages until our Fail says no write is in flight any more
            self.links.fail(msg.room, f"aborted by decode: {msg.reason}", True)
            return
        if r is not None and r.claim is None and not r.status.ended:
            self.links.fail(msg.room, f"aborted by decode: {msg.reason}", False)
        elif r is None and not self.rooms.ended(msg.room):
            self.end_early(msg.room, f"aborted by decode: {msg.reason}")  # not queued yet
        if r is None or r.claim is None or r.released:
            self.links.reply(ident, m.Fail(msg.room, f"room not active: {msg.reason}"), True)

    def _registered_by_other(self, ident: bytes, room: int) -> bool:
        """Another connection claimed ``room`` or has a pending or held registration of it."""
        r = self.rooms.get(room)
        if r is not None and r.claim is not None:
            return r.claim.ident != ident
        pending = self._pending.get(room)
        if pending is not None:
            return pending[0] != ident
        return any(
            other != ident and any(reg.room == room for reg in peer.held)
            for other, peer in self.peers.items()
        )

    def _drop_registration(self, ident: bytes, room: int) -> bool:
        """Forget this connection's pending or held registration of ``room``; True if it had one."""
        pending = self._pending.get(room)
        if pending is not None and pending[0] == ident:
            del self._pending[room]
            self.peers.remove_pending(ident)
            return True
        peer = self.peers.known(ident)
        if peer is not None and any(reg.room == room for reg in peer.held):
            peer.held = [reg for reg in peer.held if reg.room != room]
            return True
        return False


def _peer_address(frame: zmq.Frame) -> str | None:
    try:
        return frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError):
        return None
