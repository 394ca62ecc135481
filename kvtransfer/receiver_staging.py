"""Decode's staged path (a mixin of :class:`~kvtransfer.receiver.KVReceiver`, control thread).

Decode owns a registered staging region of ``staging_recv_slots`` slots and lends slots to
rooms: on a Want from the prefill that claimed the room, up to ``staging_grants_per_room``
slots (FIFO among waiting rooms). A slot belongs to ONE room from its Grant until the room is
released, so it is reused only under the same write fence as the room's pages (quarantine).
A Staged is served only for a slot lent to that room and not yet written; its bounds are
checked against the slot, the entry and the room's page list, and decode scatters it into the
pages IT registered for that room (:func:`~kvtransfer.layout.staging_rows` with its own page
list): a chunk cannot land outside a claimed page. Anything else fails that room only.
"""

from __future__ import annotations

import logging
from collections import deque

from . import messages as m
from .layout import staging_rows
from .staging import StagingArea

log = logging.getLogger(__name__)


class ReceiverStaging:
    def init_staging(self, tensors: dict | None) -> None:
        cfg = self.config
        self.staging: StagingArea | None = None
        if tensors and cfg.staging_slot_bytes:
            self.staging = StagingArea(
                tensors, self.layouts, cfg.staging_recv_slots, cfg.staging_slot_bytes
            )
            self.engine.register(self.staging.addr, self.staging.nbytes)
        self._slot_free: deque[int] = deque(range(cfg.staging_recv_slots))
        self._slot_owner: dict[int, int] = {}  # slot -> room
        self._slot_lent: set[int] = set()  # granted, not yet reported Staged
        self._wanting: dict[int, int] = {}  # room -> slots still to lend (FIFO order)

    def staging_fields(self) -> dict:
        st = self.staging
        if st is None:
            return {}
        return dict(staging_addr=st.addr, staging_slots=st.slots, staging_slot_bytes=st.slot_bytes)

    def on_want(self, r, msg: m.Want) -> None:
        if self.staging is None or r.room in self._wanting:
            self.drop("unexpected", f"want for room {r.room}")
            return
        held = sum(1 for room in self._slot_owner.values() if room == r.room)
        n = min(max(0, msg.slots), self.config.staging_grants_per_room) - held
        if n > 0:
            self._wanting[r.room] = n
            self._lend()

    def _lend(self) -> None:
        while self._slot_free and self._wanting:
            room = next(iter(self._wanting))
            r = self.rooms.get(room)
            if r is None or r.status.ended or r.claimed_by is None:
                del self._wanting[room]
                continue
            slot = self._slot_free.popleft()
            self._slot_owner[slot] = room
            self._grant(r, slot)
            self._wanting[room] -= 1
            if not self._wanting[room]:
                del self._wanting[room]

    def _grant(self, r, slot: int) -> None:
        self._slot_lent.add(slot)
        self.send(self._peers[r.claimed_by].sock, m.Grant(r.room, slot))

    def on_staged(self, r, msg: m.Staged) -> None:
        err = self._check_staged(r, msg)
        if err:
            self._fail(r.room, f"bad staged chunk: {err}", f"bad staged chunk: {err}")
            return
        lay = self.layouts[msg.role]
        layers = range(msg.layer_start, msg.layer_stop)
        try:
            rows = staging_rows(lay, r.pages[msg.role], layers, msg.start, msg.count)
            self.staging.scatter(msg.role, rows, msg.slot)
        except Exception as e:
            self._fail(r.room, f"bad staged chunk: {e}", f"bad staged chunk: {e}")
            return
        self._slot_lent.discard(msg.slot)
        self._grant(r, msg.slot)  # the slot stays the room's: prefill may fill it again

    def _check_staged(self, r, msg: m.Staged) -> str:
        if self.staging is None or self._slot_owner.get(msg.slot) != r.room:
            return f"slot {msg.slot} is not lent to this room"
        if msg.slot not in self._slot_lent:
            return f"slot {msg.slot} was not granted again since its last chunk"
        if msg.role not in r.roles:
            return f"entry {msg.role!r} not registered for this room"
        if msg.count < 1 or msg.count > self.staging.fits(msg.role):
            return f"{msg.count} pages do not fit one slot"
        return ""

    def staging_release(self, room: int) -> None:
        """The room's pages are released: its slots are too (same write fence)."""
        self._wanting.pop(room, None)
        mine = [s for s, owner in self._slot_owner.items() if owner == room]
        for s in mine:
            del self._slot_owner[s]
            self._slot_lent.discard(s)
            self._slot_free.append(s)
        if mine:
            self._lend()
