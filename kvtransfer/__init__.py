"""KV-cache transfer between prefill and decode pools (Mooncake data plane, ZMQ control plane).

The package face: the stages and the runtime import only these names. Importing it needs
neither Triton nor torch; Mooncake is imported lazily when a sender or receiver is built.
"""

from . import messages
from .checksum import entry_checksums
from .config import PROTOCOLS, TransferConfig
from .control import TransferFailed
from .identity import INCOMPATIBLE, Fingerprint, Identity, fingerprint, reason_of, refusal
from .layout import (
    DTYPE_SIZES,
    SCALED_DTYPES,
    EntryLayout,
    PoolLayout,
    check_compatible,
    group_transfers,
    group_units,
    shard_pieces,
)
from .messages import PROTOCOL_VERSION
from .rank_agent import AgentClient, serve_start
from .receiver import KVReceiver
from .sender import KVSender
from .state import RoomStatus

__all__ = [
    "DTYPE_SIZES",
    "INCOMPATIBLE",
    "PROTOCOLS",
    "PROTOCOL_VERSION",
    "SCALED_DTYPES",
    "AgentClient",
    "EntryLayout",
    "Fingerprint",
    "Identity",
    "KVReceiver",
    "KVSender",
    "PoolLayout",
    "RoomStatus",
    "TransferConfig",
    "TransferFailed",
    "check_compatible",
    "entry_checksums",
    "fingerprint",
    "group_transfers",
    "group_units",
    "messages",
    "reason_of",
    "refusal",
    "serve_start",
    "shard_pieces",
]
