"""Decode's staged path: the staging slots it lends to rooms and scatters from (run on the
receiver's control thread).

Decode owns a registered staging region of ``staging_recv_slots`` slots and lends slots to
rooms: on a Want from the prefill that claimed the room, up to ``staging_grants_per_room``
slots (FIFO among waiting rooms). A slot belongs to ONE room from its Grant until the room is
released, so it is reused only under the same write fence as the room's pages (quarantine).
A Staged is served only for a slot lent to that room and not yet written; its bounds are
checked against the slot, the entry and the room's page list, and decode scatters it into the
pages IT registered for that room (:func:`~kvtransfer.memory.layout.staging_rows` with its own
page list): a chunk cannot land outside a claimed page. Anything else fails that room only.

Tensor parallel decode: ranks 1..N-1 have staging slots of their own (their agents,
:mod:`kvtransfer.tp.agent`), declared in the Register (``ranks``); slots are lent per rank (Want
and Grant name it) and a Staged names its rank and the heads of that rank's shard it carries
(checked against the rank's head count). Rank k's chunk is scattered by its agent while the
control thread goes on serving every other room: the room counts its scatters in flight, its
slot is lent again only once the agent answered, a Complete is acted on only once every chunk
before it was scattered, and the room's pages (and slots) are released only once no scatter
of it is in flight, so a late scatter can never land in pages another room owns.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from ..config import TransferConfig
from ..control.state import ReceiverRoom, RoomTable
from ..memory.layout import EntryLayout, staging_rows
from ..memory.staging import StagingArea
from ..protocol import messages as m
from ..tp.agent import Chunk

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReceiveLinks:
    """What the staged path does to the rest of the receiver."""

    grant: Callable[[ReceiverRoom, int, int], None]  # (room, decode rank, slot): send a Grant
    post: Callable  # run ``fn(*args)`` on the control thread later (from any thread)
    fail: Callable[[int, str], None]  # fail a room (a rank's scatter failed)
    drained: Callable[[int], None]  # the room's last scatter in flight was answered


class StagedReceives:
    """This rank's slots (``area``, None without staging) and the ranks' agents' slots, lent
    room by room. ``agents``: a TP decode's ranks 1..N-1
    (:class:`~kvtransfer.tp.agent.AgentClient`); ``links``: what it does to the receiver."""

    def __init__(
        self,
        config: TransferConfig,
        layouts: dict[str, EntryLayout],
        area: StagingArea | None,
        agents: list,
        rooms: RoomTable,
        links: ReceiveLinks,
    ):
        self.config, self.layouts, self.agents = config, layouts, agents
        self.rooms, self.links = rooms, links
        self.area = area
        self.rank_layouts: list[dict[str, EntryLayout]] = [a.layouts() for a in agents]
        self._slot_free: dict[int, deque] = {}  # rank -> its free slots
        if area is not None:
            self._slot_free[0] = deque(range(area.slots))
        for k, a in enumerate(agents, 1):
            self._slot_free[k] = deque(range(len(a.info.slot_addrs)))
        self._slot_owner: dict[tuple[int, int], int] = {}  # (rank, slot) -> room
        self._slot_lent: set[tuple[int, int]] = set()  # granted, not yet reported Staged
        self._wanting: dict[tuple[int, int], int] = {}  # (room, rank) -> slots still to lend
        self._scattering: Counter[int] = Counter()  # room -> rank scatters in flight

    def register_fields(self) -> dict:
        """The Register's staging fields (rank 0's region)."""
        st = self.area
        if st is None:
            return {}
        return dict(staging_addr=st.addr, staging_slots=st.slots, staging_slot_bytes=st.slot_bytes)

    def rank_dests(self) -> list[m.RankDest]:
        """Decode ranks 1..N-1 as the Register declares them."""
        out = []
        for a, lays in zip(self.agents, self.rank_layouts, strict=True):
            i = a.info
            heads = {role: [lay.head_start, lay.kv_heads] for role, lay in lays.items()}
            pools = {role: [lay.base_addr, lay.num_pages] for role, lay in lays.items()}
            out.append(
                m.RankDest(
                    i.session_id,
                    i.proof_addr,
                    i.proof,
                    i.slot_addrs[0],
                    len(i.slot_addrs),
                    i.slot_bytes,
                    heads,
                    pools,
                )
            )
        return out

    def on_want(self, r: ReceiverRoom, msg: m.Want) -> str | None:
        """Lend slots to the room (now, or as they come free); the reason the Want is dropped,
        or None."""
        key = (r.room, msg.rank)
        if msg.rank not in self._slot_free or key in self._wanting:
            return f"want for room {r.room} rank {msg.rank}"
        held = sum(1 for k, room in self._slot_owner.items() if (room, k[0]) == key)
        n = min(max(0, msg.slots), self.config.staging_grants_per_room) - held
        if n > 0:
            self._wanting[key] = n
            self._lend()
        return None

    def on_staged(self, r: ReceiverRoom, msg: m.Staged) -> str:
        """Scatter a chunk that landed in a slot lent to ``r`` (rank 0: now; rank k: its agent,
        answered later) and lend the slot again; the error that fails the room, or ``""``."""
        err = self._check_staged(r, msg)
        if err:
            return err
        self._slot_lent.discard((msg.rank, msg.slot))
        try:
            if msg.rank:
                self._agent_scatter(r, msg)
                return ""
            self._scatter(r, msg)
        except Exception as e:
            return str(e)
        self._grant(r, msg.rank, msg.slot)  # the slot stays the room's: prefill may fill it again
        return ""

    def scattering(self, room: int) -> int:
        """Rank scatters of ``room`` still in flight (its pages are not to be released)."""
        return self._scattering.get(room, 0)

    def release(self, room: int) -> None:
        """The room's pages are released (never while a scatter of it is in flight): its slots
        are too (same write fence)."""
        for key in [k for k in self._wanting if k[0] == room]:
            del self._wanting[key]
        mine = [k for k, owner in self._slot_owner.items() if owner == room]
        for key in mine:
            del self._slot_owner[key]
            self._slot_lent.discard(key)
            self._slot_free[key[0]].append(key[1])
        if mine:
            self._lend()

    # ---- slots -------------------------------------------------------------------------------
    def _lend(self) -> None:
        for key in list(self._wanting):
            room, rank = key
            r = self.rooms.get(room)
            if r is None or r.status.ended or r.claimed_by is None:
                del self._wanting[key]
                continue
            free = self._slot_free[rank]
            while free and self._wanting.get(key):
                slot = free.popleft()
                self._slot_owner[rank, slot] = room
                self._grant(r, rank, slot)
                self._wanting[key] -= 1
            if not self._wanting[key]:
                del self._wanting[key]

    def _grant(self, r: ReceiverRoom, rank: int, slot: int) -> None:
        self._slot_lent.add((rank, slot))
        self.links.grant(r, rank, slot)

    def _scatter(self, r: ReceiverRoom, msg: m.Staged) -> None:
        """Rank 0's chunk: a copy of one slot into the room's pages, here and now."""
        heads = (msg.head_off, msg.heads) if msg.heads else None
        layers = range(msg.layer_start, msg.layer_stop)
        rows = staging_rows(self.layouts[msg.role], r.pages[msg.role], layers, msg.start, msg.count)
        self.area.scatter(msg.role, rows, msg.slot, heads)

    def _agent_scatter(self, r: ReceiverRoom, msg: m.Staged) -> None:
        """Rank k's chunk: its agent scatters it; the answer comes back on the control thread."""
        lay = self.rank_layouts[msg.rank - 1][msg.role]
        off, n = (msg.head_off, msg.heads) if msg.heads else (0, lay.kv_heads)
        piece = (msg.role, 0, msg.rank, 0, n, 0, off)
        chunk = Chunk(
            piece, r.pages[msg.role], msg.layer_start, msg.layer_stop, msg.start, msg.count
        )
        room, rank, slot = r.room, msg.rank, msg.slot
        self._scattering[room] += 1

        def answered(ok: bool, error: str) -> None:  # the agent client's reader thread
            self.links.post(self._scattered, room, rank, slot, ok, error)

        self.agents[rank - 1].scatter(chunk, slot, answered)

    def _scattered(self, room: int, rank: int, slot: int, ok: bool, error: str) -> None:
        self._scattering[room] -= 1
        if not self._scattering[room]:
            del self._scattering[room]
        r = self.rooms.get(room)
        if not ok:
            log.warning("room %d: rank %d's scatter failed: %s", room, rank, error)
            self.links.fail(room, f"bad staged chunk: rank {rank}: {error or 'failed'}")
        elif r is not None and not r.status.ended:
            self._grant(r, rank, slot)  # the slot stays the room's: prefill may fill it again
        if room not in self._scattering:
            self.links.drained(room)

    def _check_staged(self, r: ReceiverRoom, msg: m.Staged) -> str:
        key = (msg.rank, msg.slot)
        if self._slot_owner.get(key) != r.room:
            return f"slot {msg.slot} of rank {msg.rank} is not lent to this room"
        if key not in self._slot_lent:
            return f"slot {msg.slot} was not granted again since its last chunk"
        if msg.role not in r.roles:
            return f"entry {msg.role!r} not registered for this room"
        if msg.rank and msg.role not in self.rank_layouts[msg.rank - 1]:
            return f"rank {msg.rank} holds no {msg.role!r} entry"
        if msg.rank == 0:
            lay, size = self.layouts[msg.role], self.area.slot_bytes
        else:
            lay = self.rank_layouts[msg.rank - 1][msg.role]
            size = self.agents[msg.rank - 1].info.slot_bytes
        end = msg.head_off + msg.heads
        if msg.heads < 0 or (msg.heads and not 0 <= msg.head_off < end <= lay.kv_heads):
            return f"heads [{msg.head_off}, {end}) outside the rank's {lay.kv_heads}"
        heads = msg.heads or lay.kv_heads
        unit = lay.page_size * heads * lay.head_dim * lay.elem_size
        if msg.count < 1 or msg.count * unit > size:
            return f"{msg.count} pages do not fit one slot"
        return ""
