"""Room state machine: a monotonic IntEnum with a sticky Failed, and a table with tombstones.

``Bootstrapping -> WaitingForInput -> Transferring -> Success``; any live state may go to
``Failed``. Success and Failed end the room; an ended room leaves the live table and becomes a
tombstone, so a late or duplicate message for it is ignored and never recreates it.
"""

from __future__ import annotations

import enum
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

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
    (:class:`~kvtransfer.sender.SenderRoom`, :class:`~kvtransfer.receiver.ReceiverRoom`)."""

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
