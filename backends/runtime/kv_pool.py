"""The KV pool of one model: one contiguous buffer shaped by ``EntryLayout`` plus a page allocator.

Pages are handed out from a free list under a lock (the Triton backend calls from several
threads). Freeing a page that is not allocated raises, so a double free is caught where it
happens instead of corrupting another sequence's KV later.
"""

from __future__ import annotations

import random
import threading
from collections import deque

import torch

from kvtransfer import EntryLayout

from .dtypes import TORCH_DTYPES


class OutOfPagesError(RuntimeError):
    def __init__(self, requested: int, free: int, total: int):
        super().__init__(f"KV pool out of pages: requested {requested}, free {free} of {total}")
        self.requested, self.free, self.total = requested, free, total


class KVPool:
    """tensor: ``layout.buffer_shape()`` zeros; layout: with ``base_addr`` of that tensor."""

    def __init__(self, layout: EntryLayout, device: str | torch.device = "cpu"):
        self.tensor = torch.zeros(
            layout.buffer_shape(), dtype=TORCH_DTYPES[layout.dtype], device=device
        )
        self.layout = layout.with_pool(layout.num_pages, self.tensor.data_ptr())
        self.page_size = layout.page_size
        self.num_pages = layout.num_pages
        self._free: deque[int] = deque(range(self.num_pages))
        self._allocated: set[int] = set()
        self._lock = threading.Lock()
        self.num_scratch = 0  # pages the runtime took for itself (take_scratch)

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)

    @property
    def pages_in_use(self) -> int:
        """Pages that hold some sequence's KV (allocated, less the runtime's scratch)."""
        return self.num_pages - self.num_free - self.num_scratch

    def take_scratch(self) -> int:
        """One page for the runtime itself, for good (CUDA graphs write their padding rows'
        KV there): never a sequence's, and not counted in ``pages_in_use``."""
        page = self.alloc(1)[0]
        self.num_scratch += 1
        return page

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

    def alloc(self, n_pages: int) -> list[int]:
        if not isinstance(n_pages, int) or n_pages < 0:
            raise ValueError(f"n_pages must be a non-negative integer, got {n_pages!r}")
        with self._lock:
            if n_pages > len(self._free):
                raise OutOfPagesError(n_pages, len(self._free), self.num_pages)
            pages = [self._free.popleft() for _ in range(n_pages)]
            self._allocated.update(pages)
            return pages

    def free(self, pages: list[int]) -> None:
        with self._lock:
            bad = [p for p in pages if p not in self._allocated]
            dup = sorted({p for p in pages if pages.count(p) > 1})
            if bad or dup:
                raise ValueError(
                    f"freeing pages that are not allocated (double free?): {bad or dup}"
                )
            self._allocated.difference_update(pages)
            self._free.extend(pages)

    def shuffle_free_list(self, seed: int = 0) -> None:
        """Randomise allocation order (tests use it to get fragmented page tables)."""
        with self._lock:
            items = list(self._free)
            random.Random(seed).shuffle(items)
            self._free = deque(items)
