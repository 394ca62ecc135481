"""Transfer configuration: one frozen dataclass, validated once, loudly."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from .protocol.identity import Identity

PROTOCOLS = ("tcp", "rdma")

# Measured with mooncake-transfer-engine 0.3.13: a TCP lane queues about 2048 entries; a batch
# that overflows it fails (-1) AND leaves the engine failing every later write to that peer.
# So batches are chunked and the entries in flight per engine are capped well below that.
MOONCAKE_MAX_BATCH_ENTRIES = 1024
MOONCAKE_MAX_INFLIGHT_ENTRIES = 1536


@dataclass(frozen=True)
class TransferConfig:
    """Settings shared by the prefill (sender) and decode (receiver) sides.

    host: address sockets bind to and the transfer engine listens on (never 0.0.0.0 by default).
    bootstrap_port: prefill's control (ZMQ ROUTER) port; 0 picks a free port.
    protocol / rdma_device: Mooncake transport; ``rdma_device`` (e.g. "mlx5_0") only with rdma.
    bootstrap_timeout_s: how long a room waits for its peer (decode's registration at prefill,
        prefill's claim at decode); unclaimed registrations expire after it too.
    transfer_timeout_s: once claimed, the room must end (prefill compute + all writes) in this time.
    shared_secret: when set, every control message carries an HMAC-SHA256 and unsigned or
        wrongly signed messages are dropped. Both sides must use the same secret.
    num_workers: transfer threads (each submits batches and polls their completion).
    max_batch_entries: copies per Mooncake batch (chunks bigger sends).
    max_inflight_entries: copies in flight per engine, all workers together.
    heartbeat_interval_s / heartbeat_misses: decode pings each prefill peer it waits on; a peer
        silent for interval * misses, with ``misses`` pings unanswered, is declared lost and its
        rooms fail (their pages stay quarantined until the peer is proven gone or confirms its
        writes drained). A decode stalled itself sends no pings, so its stall is not the peer's.
    tombstones: how many ended rooms are remembered to drop late/duplicate messages.
    queue_timeout_s: how long a request may wait in a queue before anything was computed for
        it (prefill: for decode's registration; decode: for prefill's compute after the claim,
        on top of transfer_timeout_s). Waiting is backpressure, not failure, up to this bound.
    max_message_age_s: with a secret, signed frames older (or newer) than this are dropped as
        replays; 0 disables the check.
    max_pending_per_peer: unclaimed registrations kept per decode connection (flood guard).
    max_frame_bytes: largest control frame accepted (0: derived from the pool layouts).
    staging_slot_bytes: size of one staging slot (0: no staging, every page is its own copy);
        used when a side is given its pools' tensors. A layer group whose direct copies would
        average under ``staging_min_copy_bytes`` is gathered into slots, sent as one write per
        slot and scattered by decode (each copy costs ~50-80 us in Mooncake's TCP transport
        whatever its size, measured: 6 KB copies run at 0.05-0.09 GB/s).
    staging_slots: prefill's local slots (gathered chunks), at most ``staging_inflight``
        writes in flight; decode: ``staging_recv_slots`` slots lent to rooms,
        ``staging_grants_per_room`` at most per room.
    kv_checksum: prefill sends a CRC32C per entry and layer of the room's KV in Complete and
        decode verifies it over the bytes that landed before the room may run (checksum.py);
        a mismatch fails the room. Both sides must agree (it is part of the fingerprint).
    identity: the stage's model identity (protocol/identity.py); with it, decode sends its
        fingerprint in every Register and prefill refuses a different one at once.
    """

    host: str = "127.0.0.1"
    bootstrap_port: int = 0
    protocol: str = "tcp"
    rdma_device: str = ""
    bootstrap_timeout_s: float = 30.0
    transfer_timeout_s: float = 120.0
    shared_secret: bytes | None = None
    num_workers: int = 1
    max_batch_entries: int = 1024
    max_inflight_entries: int = 1024
    heartbeat_interval_s: float = 1.0
    heartbeat_misses: int = 5
    tombstones: int = 65536
    queue_timeout_s: float = 600.0
    max_message_age_s: float = 120.0
    max_pending_per_peer: int = 256
    max_frame_bytes: int = 0
    staging_slot_bytes: int = 8 << 20
    staging_slots: int = 3
    staging_inflight: int = 2
    staging_recv_slots: int = 12
    staging_grants_per_room: int = 3
    staging_min_copy_bytes: int = 512 << 10
    kv_checksum: bool = False
    identity: Identity | None = None

    def __post_init__(self) -> None:
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            if not self.host or any(c.isspace() for c in self.host):
                raise ValueError(
                    f"host {self.host!r} is not an IP address or host name; use e.g. 127.0.0.1"
                ) from None
        if not isinstance(self.bootstrap_port, int) or not 0 <= self.bootstrap_port <= 65535:
            raise ValueError(
                f"bootstrap_port must be 0 (any free port) .. 65535, got {self.bootstrap_port!r}"
            )
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {self.protocol!r}")
        if self.rdma_device and self.protocol != "rdma":
            raise ValueError("rdma_device is only meaningful with protocol='rdma'")
        for name in (
            "bootstrap_timeout_s",
            "transfer_timeout_s",
            "heartbeat_interval_s",
            "queue_timeout_s",
        ):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
        if self.shared_secret is not None:
            if isinstance(self.shared_secret, str):
                object.__setattr__(self, "shared_secret", self.shared_secret.encode())
            if not isinstance(self.shared_secret, bytes) or len(self.shared_secret) < 16:
                raise ValueError(
                    "shared_secret must be at least 16 bytes (or None to disable HMAC)"
                )
        if self.max_message_age_s < 0 or self.max_frame_bytes < 0:
            raise ValueError("max_message_age_s and max_frame_bytes must be >= 0")
        for name in ("num_workers", "heartbeat_misses", "tombstones", "max_pending_per_peer"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.staging_slot_bytes < 0 or self.staging_min_copy_bytes < 0:
            raise ValueError("staging_slot_bytes and staging_min_copy_bytes must be >= 0")
        for name in (
            "staging_slots",
            "staging_inflight",
            "staging_recv_slots",
            "staging_grants_per_room",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or not 1 <= v <= 1024:
                raise ValueError(f"{name} must be an integer in 1..1024, got {v!r}")
        if not 1 <= self.max_batch_entries <= MOONCAKE_MAX_BATCH_ENTRIES:
            raise ValueError(
                f"max_batch_entries must be 1..{MOONCAKE_MAX_BATCH_ENTRIES} (larger Mooncake"
                f" batches overflow its queue), got {self.max_batch_entries!r}"
            )
        if not self.max_batch_entries <= self.max_inflight_entries <= MOONCAKE_MAX_INFLIGHT_ENTRIES:
            raise ValueError(
                f"max_inflight_entries must be max_batch_entries ({self.max_batch_entries})"
                f"..{MOONCAKE_MAX_INFLIGHT_ENTRIES}, got {self.max_inflight_entries!r}"
            )

        if self.num_workers * self.max_batch_entries > self.max_inflight_entries:
            raise ValueError(
                f"num_workers ({self.num_workers}) x max_batch_entries ({self.max_batch_entries})"
                f" exceeds max_inflight_entries ({self.max_inflight_entries}): use fewer workers"
                " or smaller batches"
            )

    @property
    def heartbeat_timeout_s(self) -> float:
        return self.heartbeat_interval_s * self.heartbeat_misses

    @property
    def is_loopback(self) -> bool:
        """The control and data planes listen on a loopback address only."""
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return self.host == "localhost"
