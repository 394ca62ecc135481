"""Decode's reading of an unsigned ``Refuse`` hint (a decision only; the receiver acts on it).

Prefill answers a Register it cannot verify (another shared secret) or read (another protocol
version) with an unsigned Refuse naming the reason and its key id. Nothing vouches for it, so
decode treats it as a hint, and what it can do is bounded: it ends only a room registered with
that very peer and not claimed yet (which the peer could also end by not answering until the
bootstrap timeout), early, with the reason in the client's error. Its pages are not trusted to
be free of writes: they stay quarantined as for any failed room, released when the peer is
proven gone or after ``transfer_timeout_s`` (the bound on any claimed write), whichever comes
first. It never changes data, never touches a claimed room or another peer's room.
"""

from __future__ import annotations

from ..control.state import ReceiverRoom
from ..protocol import messages as m

MAX_REASON_CHARS = 300


def hint_failure(
    r: ReceiverRoom | None, peer_addr: str, hint: m.Refuse, key_id: str | None
) -> str | None:
    """Why the hint ends room ``r`` (registered with ``peer_addr``, not claimed, live), or None
    when it may not touch it. ``key_id``: this decode's secret's id, named beside prefill's."""
    if r is None or peer_addr not in r.addrs or r.claimed_by or r.status.ended:
        return None
    why = hint.reason[:MAX_REASON_CHARS]
    if "secret differs" in why:
        why += f" (decode key id {key_id or '?'})"
    return why
