"""KV-cache transfer between prefill and decode pools (Mooncake data plane, ZMQ control plane).

The package face: the stages and the runtime import only these names. Importing it needs
neither Triton nor torch; Mooncake is imported lazily when a sender or receiver is built.
"""

from .config import PROTOCOLS, TransferConfig
from .control.loop import TransferFailed
from .control.state import RoomStatus
from .memory.layout import (
    DTYPE_SIZES,
    SCALED_DTYPES,
    EntryLayout,
    PoolLayout,
    check_compatible,
    group_transfers,
    group_units,
    shard_pieces,
)
from .protocol import messages
from .protocol.checksum import entry_checksums
from .protocol.identity import INCOMPATIBLE, Fingerprint, Identity, fingerprint, reason_of, refusal
from .protocol.messages import PROTOCOL_VERSION
from .receiver.receiver import KVReceiver
from .roles import Receiver, Sender
from .sender.sender import KVSender
from .tp.agent import AgentClient, serve_start

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
    "Receiver",
    "RoomStatus",
    "Sender",
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
