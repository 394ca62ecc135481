"""Prefill's staged path: a layer group whose direct copies would be small (fragmented page
tables) goes through registered slots (run on the sender's control thread).

A group becomes a :class:`_Task`: its staged stream (see :mod:`kvtransfer.memory.layout`) is
cut into chunks of at most one slot. A chunk is gathered into a free local slot once the group's
compute fence is done AND the room holds a free slot that decode granted (Want / Grant), so a
gathered chunk always has somewhere to go and rooms never wait on each other's grants; at most
``staging_inflight`` chunk writes are in flight. When a write landed, Staged tells decode to
scatter it; decode grants the slot back. The group counts as one outstanding group of the room
until its last chunk landed, so Complete still goes out only after every byte of the room is in
decode's pages.

Tensor parallelism (a room whose claim has ``pieces``, see
:func:`~kvtransfer.sender.registration.check_ranks`): every group of an entry becomes one task
per piece (which prefill rank's heads go to which decode rank). Slots are wanted and granted per
decode rank. A piece from rank 0 is gathered here (its head slice) and written as above; a piece
from rank k is gathered and written by that rank's agent (:mod:`kvtransfer.tp.agent`, at most
``staging_inflight`` chunks in flight each), into the decode rank's slot. Staged names the
decode rank and the heads of its shard.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import astuple, dataclass, field

from ..config import TransferConfig
from ..control.state import RoomTable, SenderRoom
from ..control.stats import TransferStats
from ..link.writer import SlotWriter
from ..memory.layout import (
    EntryLayout,
    ShardPiece,
    Transfer,
    group_units,
    mean_copy_bytes,
    staging_rows,
)
from ..memory.staging import StagingArea, fence_ready, is_device_event
from ..protocol import messages as m
from ..tp.agent import Chunk
from .registration import dest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StagingLinks:
    """What the staged path does to the rest of the sender (all on the control thread)."""

    reply: Callable[[bytes, m.Message], None]  # a signed message to the room's decode
    fail: Callable[[int, str], None]  # fail the room (decode is told once writes drained)
    group_done: Callable[[int, str, range, bool], None]  # one outstanding group of a room ended
    post: Callable  # run ``fn(*args)`` on the control thread later (from any thread)
    busy: Callable[[], bool]  # commands wait for the control thread


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


class StagedSends:
    """The staged groups of every room: this rank's slots (``area``, None without staging),
    their ``writer``, and the ranks' agents' capacity. ``rank_layouts``: role -> {rank: its shard};
    ``agents``: ranks 1..N-1 (:class:`~kvtransfer.tp.agent.AgentClient`)."""

    def __init__(
        self,
        config: TransferConfig,
        layouts: dict[str, EntryLayout],
        area: StagingArea | None,
        writer: SlotWriter | None,
        rank_layouts: dict[str, dict[int, EntryLayout]],
        agents: list,
        rooms: RoomTable,
        stats: TransferStats,
        links: StagingLinks,
    ):
        self.config, self.layouts, self.rank_layouts = config, layouts, rank_layouts
        self.agents, self.rooms, self.stats, self.links = agents, rooms, stats, links
        self.area, self.writer = area, writer
        self._rooms: OrderedDict[int, _RoomStage] = OrderedDict()
        self._local_free = list(range(config.staging_slots))
        self._gathered: deque[_Chunk] = deque()
        self._writes = 0  # chunk writes in flight
        self._agent_writes = [0] * len(agents)  # per rank agent (ranks 1..N-1)
        self.counts = {"groups": 0, "chunks": 0, "bytes": 0}  # landed through staging

    @property
    def active(self) -> bool:
        """Some room has staged groups (their compute fences are polled on every tick)."""
        return bool(self._rooms)

    def slot_bytes(self) -> list[int] | None:
        """Every prefill rank's slot size (rank order), None without staging here."""
        if self.area is None:
            return None
        return [self.area.slot_bytes] + [a.info.slot_bytes for a in self.agents]

    def wanted(self, r: SenderRoom, role: str) -> bool:
        """Stage this room's groups of ``role``: both sides can, the table is not one run, and
        the direct copies would be small (``staging_min_copy_bytes``)."""
        reg, st, lay = r.claim.reg, self.area, self.layouts[role]
        if st is None or reg.staging_slots < 1 or st.fits(role) < 1:
            return False
        if reg.staging_slot_bytes < lay.page_bytes:
            return False
        src = r.src_pages[role]
        mean = mean_copy_bytes(lay, src, r.claim.dst_pages(role))
        return mean < min(self.config.staging_min_copy_bytes, len(src) * lay.page_bytes)

    def add_group(self, r: SenderRoom, role: str, layers: range, fence, pieces=None) -> None:
        """Stage one group (one task, or one per TP piece): it counts as ONE outstanding group
        of the room, done when every task of it is."""
        lay = self.layouts[role]
        units = group_units(lay, len(r.src_pages[role]), layers)
        pieces = pieces or [None]
        rs = self._rooms.get(r.room)
        if rs is None:
            rs = self._rooms[r.room] = _RoomStage()
        for piece in pieces:
            t = _Task(r.room, role, layers, units, fence, piece)
            nbytes = units * (piece.unit_bytes(lay) if piece else lay.page_bytes)
            t.stat = self.stats.group_submitted(r.room, role, layers, nbytes, 0)
            if t.dst not in rs.grants:
                rs.grants[t.dst] = deque()
                want = m.Want(r.room, self.config.staging_grants_per_room, t.dst)
                self.links.reply(r.claim.ident, want)
            rs.tasks.append(t)
        r.outstanding += len(pieces) - 1  # each task retires as one group
        self.pump()

    def on_grant(self, ident: bytes, g: m.Grant) -> str | None:
        """Decode lent a slot; the reason the Grant is dropped, or None."""
        r = self.rooms.get(g.room)
        rs = self._rooms.get(g.room)
        if r is None and self.rooms.ended(g.room):
            return None  # the slot came back after the room's last chunk: nothing to do
        if r is None or rs is None or r.claim is None or r.claim.ident != ident:
            return f"grant for room {g.room} that is not staging here"
        if r.status.ended:
            return None
        grants = rs.grants.get(g.rank)
        if grants is None or not 0 <= g.slot < dest(r.claim.reg, g.rank)[2] or g.slot in grants:
            self.links.fail(g.room, f"bad staging grant: rank {g.rank} slot {g.slot}")
            return None
        grants.append(g.slot)
        self.pump()
        return None

    def pump(self) -> None:
        """Submit gathered chunks, gather the next ones, retire finished or abandoned tasks."""
        self._submit_gathered()
        for room, rs in list(self._rooms.items()):
            r = self.rooms.get(room)
            live = r is not None and not r.status.ended
            while rs.tasks and (not live or not rs.tasks[0].ok) and rs.tasks[0].inflight == 0:
                self._retire(rs.tasks.popleft(), ok=False)
            while live and (t := self._next_task(rs)) is not None:
                self._gather(r, rs, t)
                if self.links.busy():  # e.g. a FirstToken: let it out before the next gather
                    self.links.post(self.pump)
                    break
            while rs.tasks and rs.tasks[0].done:
                t = rs.tasks.popleft()
                self._retire(t, ok=t.ok and live)
        self._submit_gathered()

    def forget(self, room: int) -> None:
        """The room was released: drop its record once no chunk of it is in flight."""
        rs = self._rooms.get(room)
        if rs is not None and not any(t.inflight for t in rs.tasks):
            del self._rooms[room]

    # ---- chunks ------------------------------------------------------------------------------
    def _submit_gathered(self) -> None:
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
            if t.src == 0:
                has_room = bool(self._local_free)
            else:
                has_room = self._agent_writes[t.src - 1] < self.config.staging_inflight
            if has_room and rs.grants[t.dst]:
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

    def _gather(self, r: SenderRoom, rs: _RoomStage, t: _Task) -> None:
        lay, p, unit = self.layouts[t.role], t.piece, self._unit(t)
        part = p is not None and p.heads != self.rank_layouts[t.role][p.src].kv_heads
        heads = (p.src_off, p.heads) if part else None
        if t.src == 0:
            src_fits = self.area.fits(t.role, heads)
        else:
            src_fits = self.agents[t.src - 1].info.slot_bytes // unit
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
            c.fence = self.area.gather(t.role, rows, c.local, t.fence, heads)
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

    def _agent_send(self, r: SenderRoom, c: _Chunk) -> None:
        """Rank ``c.task.src`` gathers and writes the chunk (its agent); done on this loop."""
        t = c.task
        session, addr, _, size = dest(r.claim.reg, t.dst)
        chunk = Chunk(
            astuple(t.piece), r.src_pages[t.role], t.layers.start, t.layers.stop, c.start, c.count
        )
        self._agent_writes[t.src - 1] += 1

        def done(ok: bool, error: str) -> None:  # the agent client's reader thread
            if not ok:
                log.warning("room %d: rank %d's chunk failed: %s", t.room, t.src, error)
            self.links.post(self._chunk_done, c, ok, True)

        self.agents[t.src - 1].send(chunk, session, addr + c.remote * size, done)

    def _write(self, c: _Chunk) -> None:
        r = self.rooms.get(c.task.room)
        if r is None or r.status.ended or not c.task.ok:
            self.links.post(self._chunk_done, c, False)
            return
        t = c.task
        session, addr, _, size = dest(r.claim.reg, t.dst)
        nbytes = c.count * self._unit(t)
        xfer = Transfer(self.area.slot_addr(c.local), addr + c.remote * size, nbytes)
        self._writes += 1

        def done(ok: bool) -> None:  # on a transfer worker
            self.links.post(self._chunk_done, c, ok, True)

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
            self.counts["chunks"] += 1
            self.counts["bytes"] += c.count * self._unit(t)
            part = p is not None and p.heads != r.claim.rank_heads(t.role, p.dst)
            off, heads = (p.dst_off, p.heads) if part else (0, 0)
            layers = t.layers
            msg = m.Staged(
                t.room,
                c.remote,
                t.role,
                layers.start,
                layers.stop,
                c.start,
                c.count,
                t.dst,
                off,
                heads,
            )
            self.links.reply(r.claim.ident, msg)
        elif not ok:
            t.ok = False
        self.pump()

    def _retire(self, t: _Task, ok: bool) -> None:
        self.counts["groups"] += int(ok)
        self.stats.group_done(t.stat, ok)
        self.links.group_done(t.room, t.role, t.layers, ok)
