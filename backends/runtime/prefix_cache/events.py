"""KV cache events in vLLM's wire format, so the routers that consume vLLM's (llm-d's precise
prefix-cache scorer, Dynamo's KV router) can follow this runtime's prefix caches.

The structs below mirror ``vllm.distributed.kv_events`` of vLLM ``VLLM_MIRRORED`` (the peer
environment's version, ``benchmarks/setup_vllm_peer.sh``) field for field, with the same msgspec
options, so msgspec encodes them byte for byte as vLLM does and vLLM's own classes decode them
(``tests/unit/test_kv_events_vllm.py`` checks that with vLLM's classes where the peer exists;
``tests/unit/test_kv_events.py`` checks the raw layout everywhere):

* ``KVEventBatch`` is ``array_like``: ``[ts, events, data_parallel_rank]`` (the rank nil when
  unset: ``omit_defaults`` never shortens an array; the publisher stamps one, as vLLM's does).
* each event is a *map* tagged by its class name: ``{"type": "BlockStored", "block_hashes":
  [...], "parent_block_hash": ..., "token_ids": [...], "block_size": P, "lora_id": None,
  "medium": "GPU", "lora_name": None, "group_idx": 0}``; fields with a default are left out
  while they hold it (``omit_defaults``), the ones without (``lora_id``, ``medium``,
  ``lora_name``) are always there, even as nil.

History of the mirrored format: vLLM's first releases with KV events encoded the events
``array_like`` too and had only ``block_hashes``, ``parent_block_hash``, ``token_ids``,
``block_size``, ``lora_id``; later ones added ``medium``, ``lora_name``, ``extra_keys``,
``group_idx``, the cache-spec fields, ``locality``, ``ownership``, ``session_id``, the batch's
``data_parallel_rank``, and made events maps. A change of the mirrored version is a change here
and in ``VLLM_MIRRORED``, checked by the vLLM test.

What this runtime sends: one ``BlockStored`` per publish call (the blocks a sequence completed,
chained: ``parent_block_hash`` is the hash of the block before the first of them, None at the
start of a sequence; ``token_ids`` all their tokens; ``block_size`` the page size;
``group_idx`` 0), one ``BlockRemoved`` per eviction (its pages' hashes), ``AllBlocksCleared``
when a cache is cleared. Hashes are :func:`~.hashing.external` ints.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

VLLM_MIRRORED = "0.32.0"  # the vLLM release whose kv_events structs these mirror
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"

ExternalBlockHash = bytes | int  # vLLM's alias: ints by default, digests when configured


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of the events (tagged: ``"type"`` holds the class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # deprecated in vLLM in favour of lora_name; still on the wire
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
# What a prefix cache hands its events to (a publisher's ``put``, a list's ``extend`` in tests).
# It is called under the KV pool's lock, in the order the cache changed: it must not block.
EventSink = Callable[[list[KVEvent]], None]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    return _decoder.decode(payload)
