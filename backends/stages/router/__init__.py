"""The prefill router of a decode server: :class:`PrefillRouter` forwards each request to the
least loaded prefill server of this deployment (:mod:`.servers`) over Triton gRPC
(:mod:`.client`), or leaves it to the decode server itself (``LOCAL``); :mod:`.metrics` exports
its per-server view."""

from .client import PrefillClient, Refused
from .metrics import RouterMetrics
from .router import LOCAL, NoPrefillServer, PrefillRouter
from .servers import ServerState

__all__ = [
    "LOCAL",
    "NoPrefillServer",
    "PrefillClient",
    "PrefillRouter",
    "Refused",
    "RouterMetrics",
    "ServerState",
]
