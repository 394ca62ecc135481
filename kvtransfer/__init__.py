"""KV-cache transfer between prefill and decode pools (Mooncake data plane, ZMQ control plane).

Importing this package needs neither Triton nor torch; Mooncake is imported lazily when a
sender or receiver is built.
"""

from .config import TransferConfig
from .control import TransferFailed
from .layout import EntryLayout, PoolLayout, check_compatible, group_transfers
from .messages import PROTOCOL_VERSION
from .policy import LayerGroupPolicy
from .receiver import KVReceiver
from .sender import KVSender
from .state import RoomStatus

__all__ = [
    "PROTOCOL_VERSION",
    "EntryLayout",
    "KVReceiver",
    "KVSender",
    "LayerGroupPolicy",
    "PoolLayout",
    "RoomStatus",
    "TransferConfig",
    "TransferFailed",
    "check_compatible",
    "group_transfers",
]
