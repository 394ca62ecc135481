"""The two roles' contracts: what a stage may call on a KV sender (prefill) and a KV receiver
(decode). :class:`~kvtransfer.sender.sender.KVSender` and
:class:`~kvtransfer.receiver.receiver.KVReceiver` implement them; a test checks that they do.

Every call is safe from any thread; the callbacks a stage passes in run on the side's control
thread and must not block. A room id is a random 63-bit number both stages agree on; it is
never reused. A room ends Success or Failed exactly once, within a bounded time, and its
release callback runs exactly once after that, when no write can touch its pages any more.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from .control.state import ReleaseCallback, RoomStatus
from .link.engine import Fence


@runtime_checkable
class Sender(Protocol):
    bootstrap_addr: str  # host:port decode registers with

    def expect(
        self,
        room: int,
        num_tokens: int,
        on_registered: Callable[[int], None],
        on_release: ReleaseCallback,
    ) -> None:
        """The stage queued the room: claim decode's Register, then ``on_registered(room)``."""

    def start_room(
        self, room: int, src_pages: dict[str, list[int]], on_release: ReleaseCallback | None = None
    ) -> None:
        """The compute thread takes the room: its pages (role -> page ids)."""

    def send_group(self, room: int, role: str, layers: range, fence: Fence | None = None) -> None:
        """Those layers' pages go out once ``fence`` fired (non-blocking)."""

    def first_token(self, room: int, token: int) -> None:
        """The first token goes to decode now, before the KV landed."""

    def finish(self, room: int, first_token: int, extra: dict | None = None) -> None:
        """Complete goes out once every write of the room landed."""

    def abort(self, room: int, reason: str) -> None: ...

    def is_live(self, room: int) -> bool: ...

    def poll(self, room: int) -> RoomStatus: ...

    def failure_reason(self, room: int) -> str: ...

    def stats(self) -> dict: ...

    def close(self) -> None: ...


@runtime_checkable
class Receiver(Protocol):
    def register(
        self,
        room: int,
        bootstrap_addrs: list[str],
        dst_pages: dict[str, list[int]],
        num_tokens: int,
        on_release: ReleaseCallback,
        on_fail: Callable[[int, str], None] | None = None,
        on_first: Callable[[int, int], None] | None = None,
        first: dict[str, int] | None = None,
    ) -> None:
        """Register the prompt's pages of every entry, from block ``first[role]`` on (decode
        holds the blocks before it), with the prefill(s) at those addresses."""

    def refuse(self, room: int, bootstrap_addrs: list[str], reason: str) -> None:
        """Tell prefill this room will never be registered (decode refused the request)."""

    def result(self, room: int) -> tuple[int, dict]:
        """(first token, extra) of a room that ended Success; TransferFailed otherwise."""

    def abort(self, room: int, reason: str) -> None: ...

    def forget(self, room: int) -> None: ...

    def poll(self, room: int) -> RoomStatus: ...

    def failure_reason(self, room: int) -> str: ...

    def stats(self) -> dict: ...

    def close(self) -> None: ...
