"""Prefix caching over a KV pool, and its KV events in vLLM's wire format.

* :mod:`.hashing`: block hashes (the chain formula), what a router computes for a prompt;
* :mod:`.cache`: :class:`PrefixCache` (index, lookups, publish, eviction hook, counters) and
  :class:`Lease` (one sequence's pages: acquire, commit, quarantine, release), with the rules of
  who calls what; :func:`check_prefix_cacheable` refuses models that cannot be cached by page;
* :mod:`.events`: the msgspec mirror of ``vllm.distributed.kv_events``;
* :mod:`.publisher`: :class:`KVEventPublisher`, the ZMQ PUB + replay ROUTER a stage owns and
  hands to the cache as its event sink (the cache itself does no I/O).

Usage (one pool)::

    pub = KVEventPublisher("tcp://*:5557", topic="kv@10.0.0.5@model")   # optional
    cache = PrefixCache(pool, max_pages=pool.num_pages // 2, events=pub.put)
    lease = cache.acquire(prompt, pool.pages_needed(len(prompt) + max_tokens - 1))
    ... compute prompt[lease.num_cached_tokens:] into lease.pages ...
    lease.commit(prompt, len(prompt))      # once that KV is final (never after quarantine())
    lease.release()                        # exactly once, when the sequence ends
"""

from .cache import (
    CacheStats,
    Lease,
    LeaseError,
    LeaseState,
    Match,
    PrefixCache,
    check_prefix_cacheable,
    prefix_cache_refusal,
)
from .events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventSink,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from .hashing import block_hashes, external
from .publisher import KVEventPublisher

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CacheStats",
    "EventSink",
    "KVEventBatch",
    "KVEventPublisher",
    "Lease",
    "LeaseError",
    "LeaseState",
    "Match",
    "PrefixCache",
    "block_hashes",
    "check_prefix_cacheable",
    "decode_batch",
    "encode_batch",
    "external",
    "prefix_cache_refusal",
]
