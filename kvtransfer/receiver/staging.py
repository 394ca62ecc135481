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
(checked against the rank's head count). Rank k's chunk is scattered by its agent; the control
thread waits for that (a memory copy of one slot) so a Complete is never read before every
chunk before it was scattered.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from ..config import TransferConfig
from ..control.state import ReceiverRoom, RoomTable
from ..link.engine import Engine
from ..memory.layout import EntryLayout, staging_rows
from ..memory.staging import StagingArea
from ..protocol import messages as m
from ..tp.agent import Chunk

AGENT_SCATTER_TIMEOUT_S = 30.0
Grant = Callable[[ReceiverRoom, int, int], None]  # (room, decode rank, slot): send a Grant


class StagedReceives:
    """This rank's slots (``area``, None without staging) and the ranks' agents' slots, lent
    room by room. ``agents``: a TP decode's ranks 1..N-1
    (:class:`~kvtransfer.tp.agent.AgentClient`); ``grant`` sends a Grant to the prefill that
    claimed the room."""

    def __init__(
        self,
        config: TransferConfig,
        layouts: dict[str, EntryLayout],
        tensors: dict | None,
        engine: Engine,
        agents: list,
        rooms: RoomTable,
        grant: Grant,
    ):
        self.config, self.layouts, self.agents = config, layouts, agents
        self.rooms, self._send_grant = rooms, grant
        self.area: StagingArea | None = None
        self.rank_layouts: list[dict[str, EntryLayout]] = [a.layouts() for a in agents]
        self._slot_free: dict[int, deque] = {}  # rank -> its free slots
        if tensors and config.staging_slot_bytes:
            self.area = StagingArea(
                tensors, layouts, config.staging_recv_slots, config.staging_slot_bytes
            )
            engine.register(self.area.addr, self.area.nbytes)
            self._slot_free[0] = deque(range(config.staging_recv_slots))
        for k, a in enumerate(agents, 1):
            self._slot_free[k] = deque(range(len(a.info.slot_addrs)))
        self._slot_owner: dict[tuple[int, int], int] = {}  # (rank, slot) -> room
        self._slot_lent: set[tuple[int, int]] = set()  # granted, not yet reported Staged
        self._wanting: dict[tuple[int, int], int] = {}  # (room, rank) -> slots still to lend

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
        """Scatter a chunk that landed in a slot lent to ``r`` and lend the slot again; the
        error that fails the room, or ``""``."""
        err = self._check_staged(r, msg)
        if not err:
            try:
                self._scatter(r, msg)
            except Exception as e:
                err = str(e)
        if err:
            return err
        self._slot_lent.discard((msg.rank, msg.slot))
        self._grant(r, msg.rank, msg.slot)  # the slot stays the room's: prefill may fill it again
        return ""

    def release(self, room: int) -> None:
        """The room's pages are released: its slots are too (same write fence)."""
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
        self._send_grant(r, rank, slot)

    def _scatter(self, r: ReceiverRoom, msg: m.Staged) -> None:
        layers = range(msg.layer_start, msg.layer_stop)
        heads = (msg.head_off, msg.heads) if msg.heads else None
        pages = r.pages[msg.role]
        if msg.rank == 0:
            rows = staging_rows(self.layouts[msg.role], pages, layers, msg.start, msg.count)
            self.area.scatter(msg.role, rows, msg.slot, heads)
            return
        lay = self.rank_layouts[msg.rank - 1][msg.role]
        off, n = heads or (0, lay.kv_heads)
        piece = (msg.role, 0, msg.rank, 0, n, 0, off)
        chunk = Chunk(piece, pages, msg.layer_start, msg.layer_stop, msg.start, msg.count)
        done, got = threading.Event(), []

        def answered(ok: bool, error: str) -> None:  # the agent client's reader thread
            got.append("" if ok else error or "failed")
            done.set()

        self.agents[msg.rank - 1].scatter(chunk, msg.slot, answered)
        if not done.wait(AGENT_SCATTER_TIMEOUT_S):
            raise TimeoutError(f"rank {msg.rank} did not scatter in {AGENT_SCATTER_TIMEOUT_S:g} s")
        if got[0]:
            raise RuntimeError(f"rank {msg.rank}: {got[0]}")

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
