"""The router's view of its prefill servers' deployment identity and its own readiness (a mixin
of :class:`~.router.PrefillRouter`).

A prefill server publishes its fingerprint (``pd_deployment_info``, kvtransfer/identity.py) on
its metrics endpoint, which the router reads every ``probe_interval_s`` anyway; one that differs
from the router's own (another secret, model, draft, KV layout or protocol) is marked
``Incompatible``: never routed to, and named in the client's error. The same happens at once when
a forward is refused with ``incompatible deployment: ...`` (prefill checks the fingerprint every
forwarded request carries). It is routed to again when its published fingerprint matches (it was
restarted with the right secret or model).

Readiness: the router is ready while some prefill server is ``Up`` or it may prefill locally;
every change is logged with each server's reason and exported as ``pd_ready``.
"""

from __future__ import annotations

import enum
import logging

from kvtransfer import Fingerprint, reason_of, refusal

log = logging.getLogger(__name__)


class ServerState(enum.IntEnum):
    Down = 0  # not routed to; probed until ready
    Up = 1
    Incompatible = 2  # of another deployment: not routed to; re-checked every probe


class RouterIdentity:
    def _init_identity(self, fingerprint: Fingerprint | None) -> None:
        self.fingerprint = fingerprint
        self.refusals: dict[str, int] = {}  # servers found incompatible, by reason
        self._was_ready: bool | None = None

    def _identity_mismatch(self, s) -> str | None:
        """Why server ``s`` (its last published fingerprints) is of another deployment."""
        if self.fingerprint is None:
            return None
        for fp in getattr(s.client, "remote_fingerprints", None) or []:
            got = refusal(fp, self.fingerprint) if fp is not None else None
            if got is not None:
                return got[1]
        return None

    def _mark_incompatible(self, s, reason: str) -> None:
        with self._lock:
            if s.state == ServerState.Incompatible and s.reason == reason:
                return
            s.state, s.reason = ServerState.Incompatible, reason
            label = reason_of(reason)
            self.refusals[label] = self.refusals.get(label, 0) + 1
        log.error("%s: prefill server %s is not routed to: %s", self.name, s.name, reason)

    @property
    def ready(self) -> bool:
        """Some prefill server takes requests, or this server may prefill them itself."""
        with self._lock:
            return self.local or any(s.state == ServerState.Up for s in self.servers)

    def readiness(self) -> str:
        """Each server's state and reason, for logs and errors."""
        with self._lock:
            return "; ".join(
                f"{s.name}: {s.state.name.lower()}" + (f" ({s.reason})" if s.reason else "")
                for s in self.servers
            )

    def _log_readiness(self) -> None:
        ready = self.ready
        if ready == self._was_ready:
            return
        self._was_ready = ready
        if ready:
            log.warning("%s: ready: a prefill server is up (%s)", self.name, self.readiness())
        else:
            log.error(
                "%s: NOT READY: no compatible prefill server is up and local prefill is off (%s)",
                self.name, self.readiness(),
            )  # fmt: skip
