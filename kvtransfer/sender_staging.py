"""Prefill's staged path (a mixin of :class:`~kvtransfer.sender.KVSender`, control thread).

A layer group whose direct copies would be small (fragmented page tables) becomes a
:class:`_Task`: its staged stream (see :mod:`.layout`) is cut into chunks of at most one slot.
A chunk is gathered into a free local slot once the group's compute fence is done AND the room
holds a free slot that decode granted (Want / Grant), so a gathered chunk always has somewhere
to go and rooms never wait on each other's grants; at most ``staging_inflight`` chunk writes
are in flight. When a write landed, Staged tells decode to scatter it; decode grants the slot
back. The group counts as one outstanding group of the room until its last chunk landed, so
Complete still goes out only after every byte of the room is in decode's pages.

Tensor parallelism (a room whose claim has ``pieces``, see :func:`~.registration.check_ranks`):
every group of an entry becomes one task per piece (which prefill rank's heads go to which
decode rank). Slots are wanted and granted per decode rank. A piece from rank 0 is gathered
here (its head slice) and written as above; a piece from rank k is gathered and written by
that rank's agent (:mod:`.rank_agent`, at most ``staging_inflight`` chunks in flight each),
into the decode rank's slot. Staged names the decode rank and the heads of its shard.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from dataclasses import astuple, dataclass, field

from . import messages as m
from .layout import ShardPiece, Transfer, group_units, mean_copy_bytes, staging_rows
from .rank_agent import Chunk
from .registration import dest
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
    piece: ShardPiece | None = None  # tensor parallel: this rank pair's heads
    cursor: int = 0  # units gathered so far
    inflight: int = 0  # chunks gathered and not yet landed
    ok: bool = True
    stat: object = None

    @property
    def done(self) -> bool:
        return self.inflight == 0 and (self.cursor >= self.units or not self.ok)

    @property
    def src(self) -> int:
        return self.piece.src if self.piece else 0

    @property
    def dst(self) -> int:
        return self.piece.dst if self.piece else 0


@dataclass
class _RoomStage:
    grants: dict = field(default_factory=dict)  # decode rank -> slots it lent, to write into
    tasks: deque = field(default_factory=deque)


@dataclass
class _Chunk:
    task: _Task
    local: int | None  # None: gathered and written by a rank agent
    remote: int
    start: int
    count: int
    fence: object = None


class SenderStaging:
    def init_staging(self, tensors: dict | None, agents: list | None = None) -> None:
        cfg = self.config
        # tensor parallel: the ranks' KV agents (1..); role -> {rank: its shard's layout}
        self.agents = list(agents or [])
        self.rank_layouts = {role: {0: lay} for role, lay in self.layouts.items()}
        for k, a in enumerate(self.agents, 1):  # an agent holds the entries of its runner
            for role, lay in a.layouts().items():
                self.rank_layouts[role][k] = lay
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
        self._agent_writes = [0] * len(self.agents)  # per rank agent (ranks 1..N-1)
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

    def stage_group(self, r, role: str, layers: range, fence, pieces=None) -> None:
        """Stage one group (one task, or one per TP piece): it counts as ONE outstanding group
        of the room, done when every task of it is."""
        lay = self.layouts[role]
        units = group_units(lay, len(r.src_pages[role]), layers)
        pieces = pieces or [None]
        rs = self._stage_rooms.get(r.room)
        if rs is None:
            rs = self._stage_rooms[r.room] = _RoomStage()
        for piece in pieces:
            t = _Task(r.room, role, layers, units, fence, piece)
            nbytes = units * (piece.unit_bytes(lay) if piece else lay.page_bytes)
            t.stat = self.transfer_stats.group_submitted(r.room, role, layers, nbytes, 0)
            if t.dst not in rs.grants:
                rs.grants[t.dst] = deque()
                want = m.Want(r.room, self.config.staging_grants_per_room, t.dst)
                self.send(self.router, want, r.claim.ident)
            rs.tasks.append(t)
        r.outstanding += len(pieces) - 1  # each task retires as one group
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
        grants = rs.grants.get(g.rank)
        if grants is None or not 0 <= g.slot < dest(r.claim.reg, g.rank)[2] or g.slot in grants:
            self._fail(g.room, f"bad staging grant: rank {g.rank} slot {g.slot}", True)
            return
        grants.append(g.slot)
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
            while live and (t := self._next_task(rs)) is not None:
                self._gather(r, rs, t)
                if self.has_commands():  # e.g. a FirstToken: let it out before the next gather
                    self.call(self.stage_pump)
                    break
            while rs.tasks and rs.tasks[0].done:
                t = rs.tasks.popleft()
                self._retire(t, ok=t.ok and live)
        while self._gathered and self._writes < self.config.staging_inflight:
            self._write(self._gathered.popleft())

    def _next_task(self, rs: _RoomStage) -> _Task | None:
        """The first task with units left whose compute is done and that has a granted slot
        on its decode rank and room on its prefill rank (a local slot, or agent capacity)."""
        for t in rs.tasks:
            if not t.ok or t.cursor >= t.units:
                continue
            if not self._fence_ready(t):
                return None  # later groups' compute is later still
            room = (self._local_free if t.src == 0
                    else self._agent_writes[t.src - 1] < self.config.staging_inflight)  # fmt: skip
            if room and rs.grants[t.dst]:
                return t
        return None

    def _fence_ready(self, t: _Task) -> bool:
        if t.src and is_device_event(t.fence):  # another rank's gather cannot wait on it
            return bool(t.fence.query())
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
        lay, p, unit = self.layouts[t.role], t.piece, self._unit(t)
        part = p is not None and p.heads != self.rank_layouts[t.role][p.src].kv_heads
        heads = (p.src_off, p.heads) if part else None
        src_fits = (self.staging.fits(t.role, heads) if t.src == 0
                    else self.agents[t.src - 1].info.slot_bytes // unit)  # fmt: skip
        count = min(src_fits, dest(r.claim.reg, t.dst)[3] // unit, t.units - t.cursor)
        remote = rs.grants[t.dst].popleft()
        c = _Chunk(t, None, remote, t.cursor, count)
        t.cursor += count
        t.inflight += 1
        if t.src:
            self._agent_send(r, c)
            return
        rows = staging_rows(lay, r.src_pages[t.role], t.layers, c.start, count)
        c.local = self._local_free.pop()
        try:
            c.fence = self.staging.gather(t.role, rows, c.local, t.fence, heads)
        except Exception:
            log.exception("staging gather failed: room %d group fails", t.room)
            self._local_free.append(c.local)
            t.ok, t.inflight = False, t.inflight - 1
            return
        self._gathered.append(c)

    def _unit(self, t: _Task) -> int:
        """Bytes of one unit of ``t``'s stream: a page row, or the piece's heads of it."""
        lay = self.layouts[t.role]
        return t.piece.unit_bytes(lay) if t.piece else lay.page_bytes

    def _agent_send(self, r, c: _Chunk) -> None:
        """Rank ``c.task.src`` gathers and writes the chunk (its agent); done on this loop."""
        t = c.task
        session, addr, _, size = dest(r.claim.reg, t.dst)
        chunk = Chunk(astuple(t.piece), r.src_pages[t.role], t.layers.start, t.layers.stop,
                      c.start, c.count)  # fmt: skip
        self._agent_writes[t.src - 1] += 1

        def done(ok: bool, error: str) -> None:  # the agent client's reader thread
            if not ok:
                log.warning("room %d: rank %d's chunk failed: %s", t.room, t.src, error)
            self.call(self._chunk_done, c, ok, True)

        self.agents[t.src - 1].send(chunk, session, addr + c.remote * size, done)

    def _write(self, c: _Chunk) -> None:
        r = self.rooms.get(c.task.room)
        if r is None or r.status.ended or not c.task.ok:
            self.call(self._chunk_done, c, False)
            return
        t = c.task
        session, addr, _, size = dest(r.claim.reg, t.dst)
        xfer = Transfer(self.staging.slot_addr(c.local), addr + c.remote * size,
                        c.count * self._unit(t))  # fmt: skip
        self._writes += 1

        def done(ok: bool) -> None:  # on a transfer worker
            self.call(self._chunk_done, c, ok, True)

        self.writer.submit(session, xfer, done, c.fence)

    def _chunk_done(self, c: _Chunk, ok: bool, was_written: bool = False) -> None:
        t, p = c.task, c.task.piece
        if c.local is None:
            self._agent_writes[t.src - 1] -= 1
        else:
            self._writes -= int(was_written)
            self._local_free.append(c.local)
        t.inflight -= 1
        r = self.rooms.get(t.room)
        if ok and r is not None and not r.status.ended:
            self.staged["chunks"] += 1
            self.staged["bytes"] += c.count * self._unit(t)
            part = p is not None and p.heads != r.claim.rank_heads(t.role, p.dst)
            off, heads = (p.dst_off, p.heads) if part else (0, 0)
            msg = m.Staged(t.room, c.remote, t.role, t.layers.start, t.layers.stop, c.start,
                           c.count, t.dst, off, heads)  # fmt: skip
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

