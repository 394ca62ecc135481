"""Room state: a monotonic IntEnum with a sticky Failed, each side's typed room, and a table
with tombstones.

``Bootstrapping -> WaitingForInput -> Transferring -> Success``; any live state may go to
``Failed``. Success and Failed end the room; an ended room leaves the live table and becomes a
tombstone, so a late or duplicate message for it is ignored and never recreates it.
"""

from __future__ import annotations

import enum
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from ..memory.layout import EntryLayout
from ..protocol import messages as m
from .stats import GroupStat

DEBUG = os.environ.get("KVTRANSFER_DEBUG", "") not in ("", "0")


class RoomStatus(enum.IntEnum):
    Failed = 0
    Bootstrapping = 1  # waiting for the peer (decode's registration / prefill's claim)
    WaitingForInput = 2  # peers paired, no KV written yet
    Transferring = 3  # KV writes under way
    Success = 4

    @property
    def ended(self) -> bool:
        return self in (RoomStatus.Success, RoomStatus.Failed)


class TransitionError(RuntimeError):
    pass


ReleaseCallback = Callable[[int, RoomStatus], None]


@dataclass(kw_only=True)
class Room:
    """One request's transfer on one side; each side subclasses it with its own fields
    (:class:`SenderRoom`, :class:`ReceiverRoom`)."""

    room: int
    on_release: ReleaseCallback | None = None  # runs once, when the room's pages are free
    status: RoomStatus = RoomStatus.Bootstrapping
    reason: str = ""
    deadline: float = float("inf")  # time.monotonic() by which the current phase must end
    released: bool = False  # on_release ran; the room is (or is about to be) a tombstone

    def advance(self, new: RoomStatus, reason: str = "") -> bool:
        """Move forward; returns False (and changes nothing) for a backwards/ended move."""
        if self.status.ended or (new != RoomStatus.Failed and new <= self.status):
            if DEBUG and not (new == self.status):
                raise TransitionError(f"room {self.room}: {self.status.name} -> {new.name}")
            return False
        self.status = new
        if new == RoomStatus.Failed:
            self.reason = reason or "failed"
        return True


@dataclass(frozen=True)
class Claim:
    """Decode's registration of a room, once this prefill claimed it."""

    ident: bytes  # decode's ROUTER identity: where Ack / Complete / Fail go
    reg: m.Register
    dst: dict[str, EntryLayout]  # decode's layout of each entry (its pool address)
    # tensor parallel: role -> ShardPieces (None: one rank each side, the plain paths)
    pieces: dict | None = None

    def dst_pages(self, role: str) -> list[int]:
        return next(e.pages for e in self.reg.entries if e.role == role)

    def first(self, role: str) -> int:
        """The first block of entry ``role`` decode registered a page for."""
        return next(e.first for e in self.reg.entries if e.role == role)

    def rank_heads(self, role: str, rank: int) -> int:
        """How many KV heads of entry ``role`` decode rank ``rank`` holds."""
        return self.dst[role].kv_heads if rank == 0 else self.reg.ranks[rank - 1].heads[role][1]


@dataclass(kw_only=True)
class SenderRoom(Room):
    num_tokens: int | None = None  # the prompt length, when the stage said it (expect)
    on_registered: Callable[[int], None] | None = None
    # role -> prefill's pages, from start_room: every block of the prompt, then (once the claim
    # says which blocks decode lacks) only the blocks that move
    src_pages: dict[str, list[int]] | None = None
    claim: Claim | None = None  # set once decode's Register for the room is claimed
    queued: list[tuple] = field(default_factory=list)  # (role, layers, fence) before the claim
    outstanding: int = 0  # groups whose writes are in flight
    finish: tuple[int, dict] | None = None  # (first token, extra) once prefill finished
    tell_decode: bool = False  # send Fail to decode once the writes drained
    first_token: int | None = None  # sampled before the claim: sent with the Ack


@dataclass(kw_only=True)
class ReceiverRoom(Room):
    addrs: list[str]  # prefill bootstrap addresses the Register went to
    roles: list[str]  # entries decode registered pages in
    pages: dict[str, list[int]] = field(default_factory=dict)  # role -> the registered pages
    num_tokens: int
    epochs: dict[str, int] = field(default_factory=dict)  # peer connection epoch at Register
    on_fail: Callable[[int, str], None] | None = None  # at once when it fails (pages may wait)
    on_first: Callable[[int, int], None] | None = None  # prefill's FirstToken (room, token)
    claimed_by: str | None = None  # the prefill address that claimed the room (its Ack)
    stat: GroupStat | None = None  # transfer record, from claim to completion
    # ended by decode while a prefill may still write into the pages: the peers whose drain
    # (their Fail) or disconnection is awaited before the pages are released (quarantine)
    quarantine: set[str] | None = None
    quarantine_until: float = 0.0  # a Refuse hint's room: released then at the latest
    complete: m.Complete | None = None  # prefill's Complete, acted on once every chunk scattered


class RoomTable:
    """Live rooms plus a bounded FIFO of ended ones (room -> (status, reason))."""

    def __init__(self, max_tombstones: int = 65536):
        self.live: dict[int, Room] = {}
        self.tombstones: OrderedDict[int, tuple[RoomStatus, str]] = OrderedDict()
        self.max_tombstones = max_tombstones

    def add(self, r: Room) -> Room:
        if r.room in self.live:
            raise KeyError(f"room {r.room} already exists")
        if r.room in self.tombstones:
            raise KeyError(f"room {r.room} already ended; room ids must not be reused")
        self.live[r.room] = r
        return r

    def get(self, room: int) -> Room | None:
        return self.live.get(room)

    def ended(self, room: int) -> bool:
        return room in self.tombstones

    def bury(self, room: int) -> None:
        """Move an ended room to the tombstones."""
        r = self.live.pop(room)
        assert r.status.ended, r
        self.tombstones[room] = (r.status, r.reason)
        while len(self.tombstones) > self.max_tombstones:
            self.tombstones.popitem(last=False)

    def status(self, room: int) -> tuple[RoomStatus, str] | None:
        r = self.live.get(room)
        if r is not None:
            return r.status, r.reason
        return self.tombstones.get(room)

    def __len__(self) -> int:
        return len(self.live)
