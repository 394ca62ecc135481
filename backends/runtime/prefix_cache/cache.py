"""The prefix cache of one KV pool: page-aligned token blocks keyed by chained hashes
(:mod:`.hashing`), reference counts (the pool's), LRU eviction of unreferenced blocks.

Who calls what (every call is atomic under the pool's lock; any thread):

* **admission**: :meth:`PrefixCache.acquire` matches the prompt's leading full blocks against
  the index, takes a reference on each hit page and allocates the rest (all or nothing:
  :class:`~backends.runtime.kv_pool.OutOfPagesError` leaves nothing held). It returns a
  :class:`Lease`, the sequence's page table: ``lease.pages[:lease.num_cached_pages]`` are shared,
  read-only cached pages whose KV covers tokens ``[0, lease.num_cached_tokens)``; the rest are
  the sequence's own. :meth:`PrefixCache.fits` answers whether it would succeed now.
  :meth:`PrefixCache.adopt` makes a lease of pages the caller allocated itself (KV received
  whole from a prefill server).
* **compute** only the tokens from ``num_cached_tokens`` on, into the lease's own pages, never
  into a cached page (the cached length is a whole number of blocks, so they never share one).
* **publish**: once the KV of positions ``[0, n)`` is final (prefill of those tokens finished;
  decode generated them; a transfer into them completed with no write left in flight), the owner
  calls :meth:`Lease.commit` ``(token_ids, n)``: each full block of ``[0, n)`` not published yet
  becomes a cached page, read-only from then on, and a ``BlockStored`` event goes out. A lease
  whose pages may still receive a write (kvtransfer's receiver quarantine) is
  :meth:`Lease.quarantine` d first: that is sticky, and it never publishes again. The cache has
  no other way in, so a page is cached only by its single owner and only once declared final.
* **release** exactly once when the sequence ends (finish, cancel, error):
  :meth:`Lease.release` drops every reference; a second call raises. A cached page nobody
  references stays servable until an allocation needs it (LRU, ``BlockRemoved``).

The cached length is capped at ``len(prompt) - 1`` by default: the last prompt token is always
computed, so a full hit still yields the first token's logits; with a whole-block cap that
recomputes at most one page of tokens (``P`` tokens when the prompt fills its last page).

A cap, ``max_pages``, bounds the cached pages: publishing beyond it evicts the least recently
used idle one, or publishes nothing when every cached page is referenced.

Only models whose every layer's state is paged full-attention KV can be cached by page:
:func:`prefix_cache_refusal` says why another model cannot (sliding-window layers free or
overwrite what a later request would read; recurrent state is one slot per sequence, not per
block), and :func:`check_prefix_cacheable` refuses it loudly.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from enum import IntEnum

from ..kv_pool import KVPool, OutOfPagesError
from .events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventSink,
    KVEvent,
)
from .hashing import external, iter_block_hashes, root_hash

log = logging.getLogger(__name__)

# layer kinds (transformers' layer_types) whose state a page holds whole, or that hold none
_PAGED_KINDS = ("full_attention", "mlp", "moe")


def prefix_cache_refusal(config) -> str | None:
    """Why a model's state cannot be cached by page (None: it can). ``config``: a
    :class:`~backends.runtime.config.ModelConfig`. Every layer must keep its whole context in
    full-attention pages (or keep none)."""
    if config.has_recurrent_state:
        return (
            "the model has recurrent layers (gated DeltaNet / Mamba2): their state is one slot "
            "per sequence, not a page per block, so a cached prefix cannot restore it"
        )
    kinds = set(config.layer_types)
    # as ModelConfig.layer_window: without layer_types, sliding_window applies to every layer
    if "sliding_attention" in kinds or (config.sliding_window is not None and not kinds):
        return (
            f"the model has sliding-window layers (window {config.sliding_window}): their "
            "pages are not kept whole for every position, so a cached prefix would be wrong"
        )
    other = sorted(kinds - set(_PAGED_KINDS))
    if other:
        return f"the model has layers of kinds {other}, which the prefix cache does not know"
    return None


def check_prefix_cacheable(config) -> None:
    """ValueError naming the reason unless ``config``'s model can use the prefix cache."""
    why = prefix_cache_refusal(config)
    if why is not None:
        raise ValueError(f"prefix_cache is not supported for this model: {why}")


class LeaseError(RuntimeError):
    """A lease used against its lifecycle (publish after quarantine, release twice)."""


class LeaseState(IntEnum):
    """A lease's lifecycle; it only moves forward."""

    ACTIVE = 0  # holds its pages; commit publishes its completed blocks
    QUARANTINED = 1  # a write may still land in its own pages: never publishes again
    RELEASED = 2  # its references are dropped (exactly once)


@dataclass(frozen=True)
class Match:
    """The cached prefix of a token sequence: ``pages[i]`` holds block ``i`` (hash
    ``hashes[i]``); ``num_tokens`` tokens in all."""

    pages: tuple[int, ...]
    hashes: tuple[bytes, ...]
    num_tokens: int


@dataclass
class CacheStats:
    """Counters since the cache was made (the stages turn them into metrics)."""

    lookups: int = 0  # sequences looked up (successful acquires)
    lookup_tokens: int = 0  # their prompt tokens
    hit_tokens: int = 0  # of those, served from the cache
    stored_blocks: int = 0  # blocks published
    evicted_blocks: int = 0  # cached blocks evicted (pool pressure or the cap)
    event_errors: int = 0  # event sink calls that raised (the cache went on)

    def as_dict(self) -> dict:
        return asdict(self)


class PrefixCache:
    """The index of one :class:`~backends.runtime.kv_pool.KVPool`'s cached pages.

    ``max_pages``: at most this many cached pages (default: the whole pool).
    ``events``: where ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` go (e.g. a
    :class:`~.publisher.KVEventPublisher`'s ``put``); called under the pool's lock, so it must
    not block. ``medium``: the events' storage tier (default ``GPU`` for a CUDA pool, else
    ``CPU``). ``salt``: separates hash chains that must not meet (:mod:`.hashing`).
    ``group_idx``: the events' KV cache group (vLLM names one per attention kind; one here)."""

    def __init__(
        self,
        pool: KVPool,
        max_pages: int | None = None,
        events: EventSink | None = None,
        medium: str | None = None,
        salt: bytes = b"",
        group_idx: int = 0,
    ):
        max_pages = pool.num_pages if max_pages is None else max_pages
        if not isinstance(max_pages, int) or not 0 < max_pages <= pool.num_pages:
            raise ValueError(
                f"max_pages must be an integer in [1, {pool.num_pages}], got {max_pages!r}"
            )
        self.pool, self.page_size, self.max_pages = pool, pool.page_size, max_pages
        self.medium = medium or (MEDIUM_GPU if pool.tensor.is_cuda else MEDIUM_CPU)
        self.group_idx = group_idx
        self.events = events
        self.stats = CacheStats()
        self._root = root_hash(salt)
        self._index: dict[bytes, int] = {}  # block hash -> its cached page
        self._hash_of: dict[int, bytes] = {}  # cached page -> its block hash
        pool.attach_cache(self._forget)

    @property
    def num_cached(self) -> int:
        with self.pool.lock:
            return len(self._index)

    def cached_hash(self, page: int) -> bytes | None:
        with self.pool.lock:
            return self._hash_of.get(page)

    # ---- lookups -----------------------------------------------------------------------------
    def _cap(self, token_ids: Sequence[int], max_cached_tokens: int | None) -> int:
        cap = len(token_ids) - 1 if max_cached_tokens is None else max_cached_tokens
        return max(0, min(cap, len(token_ids)))

    def match(self, token_ids: Sequence[int], max_cached_tokens: int | None = None) -> Match:
        """The longest cached prefix of ``token_ids`` of at most ``max_cached_tokens`` tokens
        (default ``len - 1``), in whole blocks. Takes no reference and counts nothing: what it
        returns may be evicted by the next allocation."""
        cap = self._cap(token_ids, max_cached_tokens)
        pages, hashes = [], []
        with self.pool.lock:
            for h in iter_block_hashes(token_ids[:cap], self.page_size, self._root):
                page = self._index.get(h)
                if page is None:
                    break
                pages.append(page)
                hashes.append(h)
        return Match(tuple(pages), tuple(hashes), len(pages) * self.page_size)

    def _plan(self, token_ids, num_pages: int, max_cached_tokens) -> tuple[Match, int, int]:
        """(the match, limited to num_pages; pages to allocate; pages an allocation can get
        once the hits are referenced)."""
        m = self.match(token_ids, max_cached_tokens)
        if len(m.pages) > num_pages:
            k = num_pages
            m = Match(m.pages[:k], m.hashes[:k], k * self.page_size)
        idle_hits = sum(1 for p in m.pages if self.pool.refcount(p) == 0)
        return m, num_pages - len(m.pages), self.pool.num_free - idle_hits

    def fits(
        self, token_ids: Sequence[int], num_pages: int, max_cached_tokens: int | None = None
    ) -> bool:
        """Whether :meth:`acquire` with these arguments would succeed now."""
        with self.pool.lock:
            _, need, available = self._plan(token_ids, num_pages, max_cached_tokens)
            return need <= available

    def acquire(
        self, token_ids: Sequence[int], num_pages: int, max_cached_tokens: int | None = None
    ) -> Lease:
        """A lease of ``num_pages`` pages for a sequence starting with ``token_ids``: the cached
        prefix (at most ``max_cached_tokens`` tokens, default ``len(token_ids) - 1``) shared,
        the rest freshly allocated. OutOfPagesError (nothing held) when they do not fit."""
        if not isinstance(num_pages, int) or num_pages < 0:
            raise ValueError(f"num_pages must be a non-negative integer, got {num_pages!r}")
        with self.pool.lock:
            m, need, available = self._plan(token_ids, num_pages, max_cached_tokens)
            if need > available:
                raise OutOfPagesError(need, available, self.pool.num_pages)
            self.pool.share(list(m.pages))
            own = self.pool.alloc(need)
            self.stats.lookups += 1
            self.stats.lookup_tokens += len(token_ids)
            self.stats.hit_tokens += m.num_tokens
            return Lease(self, list(m.pages) + own, list(m.hashes))

    def adopt(self, pages: list[int]) -> Lease:
        """A lease of ``pages`` (allocated from this pool by the caller, who hands their one
        reference over): nothing cached, every page the lease's own."""
        with self.pool.lock:
            bad = [p for p in pages if self.pool.refcount(p) != 1 or self.pool.is_cached(p)]
            if bad or len(set(pages)) != len(pages):
                raise ValueError(f"adopt needs pages held once by the caller only, not {bad}")
            return Lease(self, list(pages), [])

    # ---- changes -----------------------------------------------------------------------------
    def clear(self) -> None:
        """Forget every cached block (``AllBlocksCleared``): idle pages are free at once, the
        referenced ones when their last holder releases them."""
        with self.pool.lock:
            pages = list(self._hash_of)
            self._index.clear()
            self._hash_of.clear()
            self.pool.uncache(pages)
            self._emit([AllBlocksCleared()])

    def _room(self) -> bool:
        """Whether one more page may be cached (evicting an idle one at the cap)."""
        return len(self._index) < self.max_pages or self.pool.evict(1) == 1

    def _store(self, page: int, block_hash: bytes) -> None:
        self.pool.mark_cached(page)
        self._index[block_hash] = page
        self._hash_of[page] = block_hash
        self.stats.stored_blocks += 1

    def _forget(self, pages: list[int]) -> None:
        """The pool evicts ``pages`` (idle, cached): drop them from the index, tell the sink."""
        hashes = [self._hash_of.pop(p) for p in pages]
        for h in hashes:
            del self._index[h]
        self.stats.evicted_blocks += len(pages)
        self._emit([BlockRemoved([external(h) for h in hashes], self.medium, self.group_idx)])

    def _stored_event(self, parent: bytes | None, hashes: list[bytes], tokens: list[int]):
        return BlockStored(
            block_hashes=[external(h) for h in hashes],
            parent_block_hash=None if parent is None else external(parent),
            token_ids=tokens,
            block_size=self.page_size,
            lora_id=None,
            medium=self.medium,
            lora_name=None,
            group_idx=self.group_idx,
        )

    def _emit(self, events: list[KVEvent]) -> None:
        if self.events is None or not events:
            return
        try:
            self.events(events)
        except Exception:  # the cache's state is already consistent: go on without them
            self.stats.event_errors += 1
            log.exception("prefix cache event sink failed (%d events lost)", len(events))


class Lease:
    """One sequence's pages in a cached pool (made by :meth:`PrefixCache.acquire` or
    :meth:`PrefixCache.adopt`). ``pages``: its page table, cached prefix first."""

    def __init__(self, cache: PrefixCache, pages: list[int], hashes: list[bytes]):
        self.cache = cache
        self._pages = pages
        self._hashes = hashes  # block hashes of blocks [0, len): the hits, then committed ones
        self.num_cached_pages = len(hashes)
        self._done = len(hashes)  # blocks commit has handled (hits count as handled)
        self.state = LeaseState.ACTIVE

    @property
    def pages(self) -> list[int]:
        return list(self._pages)

    @property
    def num_cached_tokens(self) -> int:
        """Tokens whose KV came from the cache (compute starts there)."""
        return self.num_cached_pages * self.cache.page_size

    @property
    def committed_tokens(self) -> int:
        """Tokens of the blocks already published or found cached."""
        return self._done * self.cache.page_size

    def _check(self, what: str) -> None:
        if self.state != LeaseState.ACTIVE:
            raise LeaseError(f"cannot {what} a lease that is {self.state.name.lower()}")

    def grow(self, n: int) -> None:
        """``n`` more pages of the lease's own (OutOfPagesError: none)."""
        with self.cache.pool.lock:
            self._check("grow")
            self._pages += self.cache.pool.alloc(n)

    def commit(self, token_ids: Sequence[int], num_tokens: int) -> int:
        """Declare the KV of positions ``[0, num_tokens)`` final and publish every full block of
        it not handled yet (``token_ids``: the sequence's tokens, at least that many). A block
        another page already caches is left to that page (this one stays the lease's own).
        Returns how many blocks became cached. LeaseError unless the lease is active."""
        c, P = self.cache, self.cache.page_size
        full = min(num_tokens, len(token_ids)) // P
        full = min(full, len(self._pages))
        with c.pool.lock:
            self._check("publish")
            if full <= self._done:
                return 0
            parent = self._hashes[-1] if self._hashes else c._root
            new = iter_block_hashes(token_ids[: full * P], P, parent, self._done)
            runs: list[tuple[int, int]] = []  # [a, b): consecutive blocks stored now
            for i, h in zip(range(self._done, full), new, strict=True):
                if h not in c._index and c._room():
                    c._store(self._pages[i], h)
                    if runs and runs[-1][1] == i:
                        runs[-1] = (runs[-1][0], i + 1)
                    else:
                        runs.append((i, i + 1))
                self._hashes.append(h)
            self._done = full
            # one BlockStored per run, chained to the block before it (None: the first block)
            events: list[KVEvent] = [
                c._stored_event(
                    self._hashes[a - 1] if a else None,
                    self._hashes[a:b],
                    list(token_ids[a * P : b * P]),
                )
                for a, b in runs
            ]
            c._emit(events)
            return sum(b - a for a, b in runs)

    def quarantine(self) -> None:
        """A write may still land in this lease's pages: it never publishes again (sticky)."""
        with self.cache.pool.lock:
            if self.state == LeaseState.ACTIVE:
                self.state = LeaseState.QUARANTINED

    def release(self) -> None:
        """Drop every reference the lease holds, exactly once (LeaseError the second time).
        The deepest blocks go idle first, so LRU evicts a chain from its end."""
        with self.cache.pool.lock:
            if self.state == LeaseState.RELEASED:
                raise LeaseError("lease released twice")
            self.state = LeaseState.RELEASED
            pages, self._pages = self._pages, []
            self.cache.pool.free(pages[::-1])
