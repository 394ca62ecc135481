"""The KV pool of one model: one contiguous buffer shaped by ``EntryLayout`` plus a page allocator.

Pages are handed out from a free list under a lock (the Triton backend calls from several
threads). Every page that is not free has a reference count: :meth:`KVPool.alloc` gives pages
one reference each (their holder's, the only one that may write them) and :meth:`KVPool.free`
drops one. Freeing a page that holds no reference raises, so a double free is caught where it
happens instead of corrupting another sequence's KV later.

A prefix cache (:mod:`backends.runtime.prefix_cache`) may mark pages *cached*: their content
is final and indexed, they are read-only, and several sequences may reference one at once
(:meth:`KVPool.share`). A cached page whose last reference is dropped is not freed: it stays
*idle* (still servable) in LRU order until an allocation needs it. Page states::

    FREE --alloc--> OWNED (1 ref, writable) --free--> FREE
    OWNED --mark_cached--> CACHED (refs >= 1, read-only) --share / free--> CACHED
    CACHED --last free--> IDLE (0 refs, LRU) --share--> CACHED
    IDLE --evict (alloc under pressure, the cache's cap)--> FREE   (the cache is told first)

:attr:`KVPool.num_free` counts FREE + IDLE pages: what an allocation can get now. An
allocation takes FREE pages first and evicts the least recently used IDLE ones only for the
rest, so it fails (:class:`OutOfPagesError`) only when free and idle pages together are too few,
and then evicts nothing. No page with a reference is ever evicted.
"""

from __future__ import annotations

import random
import threading
from collections import OrderedDict, deque
from collections.abc import Callable

import torch

from kvtransfer import EntryLayout

from .dtypes import torch_dtype
from .state_pool import StatePool


class OutOfPagesError(RuntimeError):
    def __init__(self, requested: int, free: int, total: int):
        super().__init__(f"KV pool out of pages: requested {requested}, free {free} of {total}")
        self.requested, self.free, self.total = requested, free, total


class KVPool:
    """tensor: ``layout.buffer_shape()`` zeros; layout: with ``base_addr`` of that tensor.

    ``lock`` guards the page state (free list, references, cached and idle pages); a prefix
    cache attached to this pool keeps its index under the same lock, so a page's references and
    its cache entry always change together."""

    def __init__(
        self,
        layout: EntryLayout,
        device: str | torch.device = "cpu",
        states: StatePool | None = None,
        window: KVPool | None = None,
    ):
        self.tensor = torch.zeros(
            layout.buffer_shape(), dtype=torch_dtype(layout.dtype), device=device
        )
        self.layout = layout.with_pool(layout.num_pages, self.tensor.data_ptr())
        self.page_size = layout.page_size
        self.num_pages = layout.num_pages
        self._free: deque[int] = deque(range(self.num_pages))
        self._refs: dict[int, int] = {}  # page -> references, for every page not FREE or IDLE
        self._cached: set[int] = set()  # CACHED and IDLE pages (read-only, indexed by a cache)
        self._idle: OrderedDict[int, None] = OrderedDict()  # IDLE pages, least recently used first
        self._on_evict: Callable[[list[int]], None] | None = None
        self.lock = threading.RLock()
        self.num_scratch = 0  # pages the runtime took for itself (take_scratch)
        # a model with recurrent layers: their per-sequence state slots (one per sequence)
        self.states = states
        # a model mixing sliding-window and full layers: its sliding layers' entry (a KVPool of
        # role {model}.window, of which a sequence holds only its window's pages: see window.py)
        self.window = window
        self._placeholder: int | None = None

    @property
    def num_free(self) -> int:
        """Pages an allocation can get now: free ones and idle cached ones (evicted on demand)."""
        with self.lock:
            return len(self._free) + len(self._idle)

    @property
    def pages_in_use(self) -> int:
        """Pages that hold some sequence's KV (referenced, less the runtime's scratch)."""
        return self.num_pages - self.num_free - self.num_scratch

    @property
    def num_cached(self) -> int:
        """Cached pages, referenced or idle."""
        return len(self._cached)  # (one read: no lock needed)

    @property
    def num_idle(self) -> int:
        """Cached pages no one references (evictable)."""
        return len(self._idle)  # (one read: no lock needed)

    def refcount(self, page: int) -> int:
        with self.lock:
            return self._refs.get(page, 0)

    def is_cached(self, page: int) -> bool:
        with self.lock:
            return page in self._cached

    def take_scratch(self) -> int:
        """One page for the runtime itself, for good (CUDA graphs write their padding rows'
        KV there): never a sequence's, and not counted in ``pages_in_use``."""
        page = self.alloc(1)[0]
        self.num_scratch += 1
        return page

    def placeholder(self) -> int:
        """The page that every block a sliding window no longer reaches maps to (one scratch
        page, taken at the first call): no sequence writes it and no layer reads it; CUDA
        graphs' padding rows may write their KV there."""
        with self.lock:
            if self._placeholder is None:
                self._placeholder = self.take_scratch()
            return self._placeholder

    @property
    def untouched(self) -> bool:
        """No page of this pool is held (not even a scratch page): a window entry may then be
        addressed with another entry's page ids (see ``SeqInput.window_pages``)."""
        with self.lock:
            return not self._refs and not self._cached

    def pages_needed(self, num_tokens: int) -> int:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.page_size)

    def check_holds(self, num_tokens: int, pages: list[int], what: str = "") -> None:
        """ValueError unless ``pages`` are enough for ``num_tokens`` tokens of this pool."""
        need = self.pages_needed(num_tokens)
        if len(pages) < need:
            raise ValueError(
                f"{num_tokens} prompt tokens need {need} {what}pages of {self.page_size},"
                f" got {len(pages)}"
            )

    # ---- references ----------------------------------------------------------------------------
    def alloc(self, n_pages: int) -> list[int]:
        """``n_pages`` pages with one reference each, exclusively the caller's (writable): free
        pages first, then the least recently used idle cached pages (evicted). All or none."""
        if not isinstance(n_pages, int) or n_pages < 0:
            raise ValueError(f"n_pages must be a non-negative integer, got {n_pages!r}")
        with self.lock:
            if n_pages > len(self._free) + len(self._idle):
                raise OutOfPagesError(n_pages, len(self._free) + len(self._idle), self.num_pages)
            short = n_pages - len(self._free)
            if short > 0:
                self.evict(short)
            pages = [self._free.popleft() for _ in range(n_pages)]
            for p in pages:
                self._refs[p] = 1
            return pages

    def free(self, pages: list[int]) -> None:
        """Drop one reference from each page: an uncached page with none left is free again, a
        cached one idle. Raises (changing nothing) when a page holds no reference."""
        with self.lock:
            bad = [p for p in pages if p not in self._refs]
            dup = sorted({p for p in pages if pages.count(p) > 1})
            if bad or dup:
                raise ValueError(
                    f"freeing pages that are not allocated (double free?): {bad or dup}"
                )
            for p in pages:
                self._refs[p] -= 1
                if self._refs[p] == 0:
                    del self._refs[p]
                    if p in self._cached:
                        self._idle[p] = None  # most recently used end
                    else:
                        self._free.append(p)

    def share(self, pages: list[int]) -> None:
        """One more reference on each cached page (a cache hit; an idle page leaves the LRU).
        Only cached pages are shared: an owned page has exactly one holder, its writer."""
        with self.lock:
            bad = [p for p in pages if p not in self._cached]
            if bad:
                raise ValueError(f"only cached pages can be shared, not {bad}")
            for p in pages:
                self._idle.pop(p, None)
                self._refs[p] = self._refs.get(p, 0) + 1

    # ---- cache hooks (used by backends.runtime.prefix_cache) ---------------------------------
    def attach_cache(self, on_evict: Callable[[list[int]], None]) -> None:
        """Let one prefix cache mark pages cached; ``on_evict(pages)`` runs (under ``lock``)
        before evicted pages become free, so the cache forgets them first."""
        with self.lock:
            if self._on_evict is not None:
                raise ValueError("this KV pool already has a prefix cache")
            self._on_evict = on_evict

    def mark_cached(self, page: int) -> None:
        """OWNED -> CACHED: the page's content is final and read-only from now on. Only a page
        its single holder owns (one reference, not cached yet) can be marked."""
        with self.lock:
            if self._on_evict is None:
                raise ValueError("no prefix cache is attached to this KV pool")
            if page in self._cached or self._refs.get(page) != 1:
                raise ValueError(
                    f"page {page} cannot be cached: it must be held by exactly one owner and "
                    f"not cached yet (references {self._refs.get(page, 0)}, "
                    f"cached {page in self._cached})"
                )
            self._cached.add(page)

    def uncache(self, pages: list[int]) -> None:
        """CACHED -> OWNED-like (freed normally by its last holder), IDLE -> FREE. The caller
        (the cache) has already forgotten them; no eviction callback runs."""
        with self.lock:
            for p in pages:
                self._cached.discard(p)
                if p in self._idle:
                    del self._idle[p]
                    self._free.append(p)

    def copy_page(self, src: int, dst: int) -> None:
        """Copy page ``src``'s KV, every layer's, into page ``dst`` (a writer's own)."""
        if self.layout.attn == "state":
            raise ValueError("a state entry has no pages to copy")
        with self.lock:
            if self._refs.get(dst) != 1 or dst in self._cached:
                raise ValueError(f"page {dst} is not exclusively held: it cannot be written")
        axis = 2 if self.layout.attn == "gqa" else 1  # [layers, (2,) pages, ...]
        self.tensor.select(axis, dst).copy_(self.tensor.select(axis, src))

    def evict(self, n: int) -> int:
        """Evict up to ``n`` least recently used idle cached pages (they become free); the
        attached cache is told first. Returns how many were evicted."""
        with self.lock:
            victims = []
            while len(victims) < n and self._idle:
                victims.append(self._idle.popitem(last=False)[0])
            if victims:
                assert self._on_evict is not None  # only a cache makes pages idle
                self._on_evict(victims)
                self._cached.difference_update(victims)
                self._free.extend(victims)
            return len(victims)

    def shuffle_free_list(self, seed: int = 0) -> None:
        """Randomise allocation order (tests use it to get fragmented page tables)."""
        with self.lock:
            items = list(self._free)
            random.Random(seed).shuffle(items)
            self._free = deque(items)
