"""The router's view of one prefill server: its state, its load, and whether it is of this
deployment; and the addresses a configured host name stands for.

Server lifecycle (:class:`ServerState`): ``Up`` until a forward breaks (connection refused or
lost), a forward's first answer or a metrics read takes longer than ``route_timeout_s``; then
``Down`` (never routed to), probed every ``probe_interval_s`` (gRPC model readiness and a metrics
read) and ``Up`` again once both work.

Deployment identity: a prefill server publishes its fingerprint (``pd_deployment_info``,
kvtransfer/protocol/identity.py) on its metrics endpoint, which the router reads every
``probe_interval_s`` anyway; one that differs from the router's own (another secret, model,
draft, KV layout or protocol) is marked ``Incompatible``: never routed to, and named in the
client's error. The same happens at once when a forward is refused as incompatible (prefill
checks the fingerprint every forwarded request carries; its error's tag carries the code
``incompatible_deployment.<what differs>``, backends/stages/errors.py). It is routed
to again when its published fingerprint matches (it was restarted with the right secret or
model).
"""

from __future__ import annotations

import enum
import ipaddress
import socket
from dataclasses import dataclass, field

from kvtransfer import Fingerprint, refusal

from .client import PrefillClient
from .prefix_index import PrefixIndex


class ServerState(enum.IntEnum):
    Down = 0  # not routed to; probed until ready
    Up = 1
    Incompatible = 2  # of another deployment: not routed to; re-checked every probe


@dataclass
class PrefillServer:
    client: PrefillClient
    state: ServerState = ServerState.Up
    reason: str = ""  # why it is down
    queued: float = 0.0  # its queue metric at the last read
    read_at: float = 0.0  # time.monotonic() of that read
    outstanding: dict[int, tuple[int, float]] = field(default_factory=dict)  # room -> (tokens, t)
    counters: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(
            ("dispatched", "tokens", "refused", "lost", "hit_tokens"), 0
        )
    )
    prefix: PrefixIndex = field(default_factory=PrefixIndex)  # the prompts routed there

    @property
    def name(self) -> str:
        return self.client.name

    def load(self) -> float:
        return self.queued + sum(n for n, t in self.outstanding.values() if t >= self.read_at)


def identity_mismatch(ours: Fingerprint | None, s: PrefillServer) -> tuple[str, str] | None:
    """(what differs, message) when server ``s`` (its last published fingerprints) is of another
    deployment than ``ours`` (None: it is not, or there is nothing to compare)."""
    if ours is None:
        return None
    for fp in getattr(s.client, "remote_fingerprints", None) or []:
        got = refusal(fp, ours) if fp is not None else None
        if got is not None:
            return got
    return None


def resolve(host: str) -> list[str]:
    """An IP address as is; a host name -> its IPv4 addresses (sorted; none if unknown)."""
    try:
        ipaddress.ip_address(host)
        return [host]
    except ValueError:
        pass
    try:
        return sorted(set(socket.gethostbyname_ex(host)[2]))
    except OSError:
        return []
