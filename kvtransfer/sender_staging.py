"""Prefill's staged path (a mixin of :class:`~kvtransfer.sender.KVSender`, control thread).

A layer group whose direct copies would be small (fragmented page tables) becomes a
:class:`_Task`: its staged stream (see :mod:`.layout`) is cut into chunks of at most one slot.
A chunk is gathered into a free local slot once the group's compute fence is done AND the room
holds a free slot that decode granted (Want / Grant), so a gathered chunk always has somewhere
to go and rooms never wait on each other's grants; at most ``staging_inflight`` chunk writes
are in flight. When a write landed, Staged tells decode to scatter it; decode grants the slot
back. The group counts as one outstanding group of the room until its last chunk landed, so
Complete still goes out only after every byte of the room is in decode's pages.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from . import messages as m
from .layout import Transfer, group_units, mean_copy_bytes, staging_rows
from .staging import StagingArea, fence_ready, is_device_event
from .writer import SlotWriter

log = logging.getLogger(__name__)


@dataclass
class _Task:
    room: int
    role: str
    layers: range
    units: int  # units in the group's staged stream
    fence: object = None
    cursor: int = 0  # units gathered so far
    inflight: int = 0  # chunks gathered and not yet landed
    ok: bool = True
    stat: object = None

    @property
    def done(self) -> bool:
        return self.inflight == 0 and (self.cursor >= self.units or not self.ok)


@dataclass
class _RoomStage:
    grants: deque = field(default_factory=deque)  # slots decode lent and we may write into
    tasks: deque = field(default_factory=deque)


@dataclass
class _Chunk:
    task: _Task
    local: int
    remote: int
    start: int
    count: int
    fence: object = None


class SenderStaging:
    def init_staging(self, tensors: dict | None) -> None:
        cfg = self.config
        self.staging: StagingArea | None = None
        if tensors and cfg.staging_slot_bytes:
            self.staging = StagingArea(
                tensors, self.layouts, cfg.staging_slots, cfg.staging_slot_bytes
            )
            self.engine.register(self.staging.addr, self.staging.nbytes)
            self.writer = SlotWriter(self.engine.native)
        self._stage_rooms: OrderedDict[int, _RoomStage] = OrderedDict()
        self._local_free = list(range(cfg.staging_slots))
        self._gathered: deque[_Chunk] = deque()
        self._writes = 0  # chunk writes in flight
        self.staged = {"groups": 0, "chunks": 0, "bytes": 0}  # landed through staging

    def use_staging(self, r, role: str) -> bool:
        """Stage this room's groups of ``role``: both sides can, the table is not one run, and
        the direct copies would be small (``staging_min_copy_bytes``)."""
        reg, st, lay = r.claim.reg, self.staging, self.layouts[role]
        if st is None or reg.staging_slots < 1 or st.fits(role) < 1:
            return False
        if reg.staging_slot_bytes < lay.page_bytes:
            return False
        src = r.src_pages[role]
        mean = mean_copy_bytes(lay, src, r.claim.dst_pages(role))
        return mean < min(self.config.staging_min_copy_bytes, len(src) * lay.page_bytes)

    def stage_group(self, r, role: str, layers: range, fence) -> None:
        lay = self.layouts[role]
        units = group_units(lay, len(r.src_pages[role]), layers)
        t = _Task(r.room, role, layers, units, fence)
        t.stat = self.transfer_stats.group_submitted(
            r.room, role, layers, units * lay.page_bytes, 0
        )
        rs = self._stage_rooms.get(r.room)
        if rs is None:
            rs = self._stage_rooms[r.room] = _RoomStage()
            want = m.Want(r.room, self.config.staging_grants_per_room)
            self.send(self.router, want, r.claim.ident)
        rs.tasks.append(t)
        self.stage_pump()

    def on_grant(self, ident: bytes, g: m.Grant) -> None:
        r = self.rooms.get(g.room)
        rs = self._stage_rooms.get(g.room)
        if r is None and self.rooms.ended(g.room):
            return  # the slot came back after the room's last chunk: nothing to do
        if r is None or rs is None or r.claim is None or r.claim.ident != ident:
            self.drop("unexpected", f"grant for room {g.room} that is not staging here")
            return
        if r.status.ended:
            return
        if not 0 <= g.slot < r.claim.reg.staging_slots or g.slot in rs.grants:
            self._fail(g.room, f"bad staging grant: slot {g.slot}", True)
            return
        rs.grants.append(g.slot)
        self.stage_pump()

    def stage_pump(self) -> None:
        """Submit gathered chunks, gather the next ones, retire finished or abandoned tasks."""
        while self._gathered and self._writes < self.config.staging_inflight:
            self._write(self._gathered.popleft())
        for room, rs in list(self._stage_rooms.items()):
            r = self.rooms.get(room)
            live = r is not None and not r.status.ended
            while rs.tasks and (not live or not rs.tasks[0].ok) and rs.tasks[0].inflight == 0:
                self._retire(rs.tasks.popleft(), ok=False)
            while live and rs.tasks and self._local_free and rs.grants:
                t = next((x for x in rs.tasks if x.ok and x.cursor < x.units), None)
                if t is None or not self._fence_ready(t):
                    break
                self._gather(r, rs, t)
                if self.has_commands():  # e.g. a FirstToken: let it out before the next gather
                    self.call(self.stage_pump)
                    break
            while rs.tasks and rs.tasks[0].done:
                t = rs.tasks.popleft()
                self._retire(t, ok=t.ok and live)
        while self._gathered and self._writes < self.config.staging_inflight:
            self._write(self._gathered.popleft())

    def _fence_ready(self, t: _Task) -> bool:
        try:
            ready = fence_ready(t.fence)
        except Exception:
            log.exception("completion fence failed: room %d group fails", t.room)
            t.ok = False
            return False
        if ready and not is_device_event(t.fence):
            t.fence = None  # done; a device event stays: the gather's stream waits for it
        return ready

    def _gather(self, r, rs: _RoomStage, t: _Task) -> None:
        st, reg = self.staging, r.claim.reg
        per_slot = min(st.fits(t.role), reg.staging_slot_bytes // self.layouts[t.role].page_bytes)
        count = min(per_slot, t.units - t.cursor)
        rows = staging_rows(self.layouts[t.role], r.src_pages[t.role], t.layers, t.cursor, count)
        local, remote = self._local_free.pop(), rs.grants.popleft()
        try:
            fence = st.gather(t.role, rows, local, t.fence)
        except Exception:
            log.exception("staging gather failed: room %d group fails", t.room)
            self._local_free.append(local)
            t.ok = False
            return
        self._gathered.append(_Chunk(t, local, remote, t.cursor, count, fence))
        t.cursor += count
        t.inflight += 1

    def _write(self, c: _Chunk) -> None:
        r = self.rooms.get(c.task.room)
        if r is None or r.status.ended or not c.task.ok:
            self.call(self._chunk_done, c, False)
            return
        reg = r.claim.reg
        nbytes = c.count * self.layouts[c.task.role].page_bytes
        dst = reg.staging_addr + c.remote * reg.staging_slot_bytes
        xfer = Transfer(self.staging.slot_addr(c.local), dst, nbytes)
        self._writes += 1

        def done(ok: bool) -> None:  # on a transfer worker
            self.call(self._chunk_done, c, ok, True)

        self.writer.submit(reg.session_id, xfer, done, c.fence)

    def _chunk_done(self, c: _Chunk, ok: bool, was_written: bool = False) -> None:
        t = c.task
        self._writes -= int(was_written)
        self._local_free.append(c.local)
        t.inflight -= 1
        r = self.rooms.get(t.room)
        if ok and r is not None and not r.status.ended:
            self.staged["chunks"] += 1
            self.staged["bytes"] += c.count * self.layouts[t.role].page_bytes
            msg = m.Staged(
                t.room, c.remote, t.role, t.layers.start, t.layers.stop, c.start, c.count
            )
            self.send(self.router, msg, r.claim.ident)
        elif not ok:
            t.ok = False
        self.stage_pump()

    def _retire(self, t: _Task, ok: bool) -> None:
        self.staged["groups"] += int(ok)
        self.transfer_stats.group_done(t.stat, ok)
        self._group_done(t.room, t.role, t.layers, ok)

    def close_staging(self) -> None:
        if self.staging is not None:
            self.writer.close()

    def stage_forget(self, room: int) -> None:
        rs = self._stage_rooms.get(room)
        if rs is not None and not any(t.inflight for t in rs.tasks):
            del self._stage_rooms[room]
