"""Decode's checks of what prefill says about a room (a mixin of
:class:`~kvtransfer.receiver.KVReceiver`, run on its control thread): the unsigned ``Refuse``
hint, and the KV checksums in ``Complete`` (``kv_checksum``, see :mod:`.checksum`).

Prefill answers a Register it cannot verify (another shared secret) or read (another protocol
version) with an unsigned Refuse naming the reason and its key id. Nothing vouches for it, so
decode treats it as a hint, and what it can do is bounded: it ends only a room registered with
that very peer and not claimed yet (which the peer could also end by not answering until the
bootstrap timeout), early, with the reason in the client's error. Its pages are not trusted to
be free of writes: they stay quarantined as for any failed room, released when the peer is
proven gone or after ``transfer_timeout_s`` (the bound on any claimed write), whichever comes
first. It never changes data, never touches a claimed room or another peer's room.
"""

from __future__ import annotations

import time

from . import messages as m
from .checksum import verify_room
from .identity import reason_of


class ReceiverChecks:
    def verify_checksums(self, r, msg: m.Complete) -> str | None:
        """With ``kv_checksum``: the error when the landed KV of any entry differs from what
        prefill summed (or prefill sent no checksums), else None."""
        if not self.config.kv_checksum:
            return None
        pages = {role: r.pages[role] for role in r.roles}
        return verify_room(
            self.layouts, self.pool_tensors, pages, msg.checksums, self.faults.flips(r.room)
        )

    def decode_or_hint(self, peer, raw: bytes) -> m.Message | None:
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

    def _on_refuse_hint(self, peer, hint: m.Refuse) -> None:
        """Prefill could not verify or read this room's Register (another secret or protocol):
        an UNSIGNED hint, so it may only end a room registered with that very peer and not yet
        claimed, early. Its pages stay quarantined (no proof that nothing writes) for at most
        ``transfer_timeout_s``, the bound on any claimed write."""
        r = self.rooms.get(hint.room)
        if r is None or peer.addr not in r.addrs or r.claimed_by or r.status.ended:
            return
        mine = self.fingerprint.key_id if self.fingerprint else "?"
        why = hint.reason[:300]
        if "secret differs" in why:
            why += f" (decode key id {mine})"
        self.count_refusal(reason_of(why), f"room {r.room}: prefill {peer.addr}: {why}")
        self._fail(r.room, f"prefill {peer.addr}: {why}")
        if r.quarantine and not r.released:
            r.quarantine_until = time.monotonic() + self.config.transfer_timeout_s

    def expire_hint_quarantine(self, r, now: float) -> None:
        if r.quarantine and r.quarantine_until and now > r.quarantine_until:
            r.quarantine.clear()  # only a Refuse hint's room: see _on_refuse_hint
            self._try_release(r)
