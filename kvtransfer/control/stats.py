"""Transfer statistics: bytes and seconds per room and per group, failures by reason."""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from dataclasses import asdict, dataclass, field


def reason_key(reason: str) -> str:
    """Counter key of a failure reason: the text before the first ':' (e.g. "bootstrap timeout")."""
    return reason.split(":", 1)[0].strip()[:64] or "unknown"


@dataclass
class GroupStat:
    role: str
    layers: tuple[int, int]
    nbytes: int
    entries: int
    submitted: float  # time.time() when queued to the engine
    done: float | None = None  # time.time() when its last batch completed
    ok: bool | None = None


@dataclass
class RoomStat:
    room: int
    started: float = field(default_factory=time.time)
    ended: float | None = None
    status: str = ""
    groups: list[GroupStat] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.groups)

    @property
    def transfer_seconds(self) -> float:
        """First group queued -> last group landed."""
        done = [g.done for g in self.groups if g.done is not None]
        if not self.groups or not done:
            return 0.0
        return max(done) - min(g.submitted for g in self.groups)


class TransferStats:
    """Thread-safe; keeps the last ``keep`` rooms in detail and totals forever."""

    def __init__(self, keep: int = 1024):
        self._lock = threading.Lock()
        self._rooms: OrderedDict[int, RoomStat] = OrderedDict()
        self._keep = keep
        self.failures: Counter[str] = Counter()
        self.total_bytes = 0
        self.total_seconds = 0.0
        self.rooms_ok = 0
        self.rooms_failed = 0
        # called (nbytes, seconds) once per room that succeeded, outside the lock (histograms)
        self.observer = None

    def room(self, room: int) -> RoomStat:
        with self._lock:
            st = self._rooms.get(room)
            if st is None:
                st = self._rooms[room] = RoomStat(room)
                while len(self._rooms) > self._keep:
                    self._rooms.popitem(last=False)
            return st

    def group_submitted(self, room: int, role: str, layers: range, nbytes: int, entries: int):
        g = GroupStat(role, (layers.start, layers.stop), nbytes, entries, time.time())
        st = self.room(room)
        with self._lock:
            st.groups.append(g)
        return g

    def group_done(self, g: GroupStat, ok: bool) -> None:
        with self._lock:
            g.done, g.ok = time.time(), ok
            if ok:
                self.total_bytes += g.nbytes

    def room_ended(self, room: int, ok: bool, reason: str = "") -> None:
        st = self.room(room)
        with self._lock:
            st.ended, st.status = time.time(), "Success" if ok else f"Failed: {reason}"
            if ok:
                self.rooms_ok += 1
                self.total_seconds += st.transfer_seconds
            else:
                self.rooms_failed += 1
                self.failures[reason_key(reason)] += 1
            done = (st.nbytes, st.transfer_seconds) if ok and st.groups else None
        if done is not None and self.observer is not None:
            self.observer(*done)

    def get_room(self, room: int) -> dict | None:
        with self._lock:
            st = self._rooms.get(room)
            if st is None:
                return None
            d = asdict(st)
            d["nbytes"], d["transfer_seconds"] = st.nbytes, st.transfer_seconds
            return d

    def snapshot(self) -> dict:
        """Totals for metrics export."""
        with self._lock:
            return {
                "bytes": self.total_bytes,
                "seconds": self.total_seconds,
                "rooms_ok": self.rooms_ok,
                "rooms_failed": self.rooms_failed,
                "failures": dict(self.failures),
                "gbps": self.total_bytes / self.total_seconds / 1e9 if self.total_seconds else 0.0,
                "at": time.time(),
            }
