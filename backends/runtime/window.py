"""Paged sliding-window KV: a sequence holds only the pages its window still reaches.

A model that mixes sliding-window and full-attention layers (Gemma 3, gpt-oss: ``layer_types``
with both kinds) keeps its sliding layers' KV in a pool entry of its own, ``pool.window`` (role
``{model}.window``, ``EntryLayout.window`` = the window ``W``; ``ModelConfig.window_kv_layers``);
a model whose every attention layer slides (Mistral), or none, keeps one entry as before. A
sliding layer's query at position ``p`` sees keys ``(p - W, p]`` and reads nothing before them
(``BatchMeta.for_window``), so a block the window has passed is never read again and its page
can hold the sequence's next block.

A sequence's :class:`WindowTable` maps every block of the sequence to a page of that entry:
``table`` is the forward's ``SeqInput.window_pages`` (a plain page table, so ``BatchMeta`` and
every kernel stay as they are), where a block out of the window maps to the pool's placeholder
page (:meth:`~backends.runtime.kv_pool.KVPool.placeholder`, never written by a sequence, never
read). With page size ``ps``, a forward writing positions ``[p, p + n)``::

    reads keys from p - W + 1 on:  live blocks [max(0, p - W + 1) // ps, (p + n - 1) // ps]
    before it:  the blocks before that go back to the sequence's spares (their pages recycled)
    then:       each block it writes that has no page takes a spare

A step writes at most ``s`` tokens a sequence (a decode step 1, a speculative verify
``k + 1``), and a sequence's forwards never start before an earlier one's start (rejected
drafts roll back only past the verify's start), so its live blocks always cover at most
``W + s - 1`` positions: at most ``R = ceil((W + s - 2) / ps) + 1`` pages (:func:`window_bound`;
one fewer than ``ceil((W + s) / ps) + 1`` where ``ps`` divides ``W + s - 1`` or ``W + s - 2``), and
never more than the ``ceil(max_kv_tokens / ps)`` blocks the sequence ever has
(:func:`pages_to_hold`). A sequence reserves that many at admission, so it never runs out
mid-generation, and holds them until it ends; during its prefill, which writes every prompt
block, it holds a page per prompt block, and gives back what is out of the window right after
(:meth:`WindowTable.settle`). Gemma 3 (window 1,024 of a 128k context, 16-token pages) holds at
most 65 pages of its sliding layers a sequence instead of 8,192.

Disaggregated: the prefill side writes the whole prompt (a page per prompt block, or a table
that advances chunk by chunk) and sends only blocks ``[first, first + count)`` of
``EntryLayout.pages_for(prompt_tokens)``; the decode side reserves :func:`plan_prefilled`'s
``reserve`` pages, registers the first ``count`` of them for those blocks, and hands all of them
to ``LLMEngine.add_prefilled(..., window_pages=...)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtransfer import EntryLayout

from .kv_pool import KVPool


def window_bound(layout: EntryLayout, step_tokens: int) -> int:
    """R: the most pages of a sliding-window entry a sequence holds once its prompt is in,
    when a forward writes at most ``step_tokens`` tokens of it (see the module docstring)."""
    if layout.window <= 0:
        raise ValueError(f"entry {layout.role} has no sliding window")
    if not isinstance(step_tokens, int) or step_tokens < 1:
        raise ValueError(f"step_tokens must be a positive integer, got {step_tokens!r}")
    return -(-(layout.window + step_tokens - 2) // layout.page_size) + 1


def pages_to_hold(layout: EntryLayout, max_kv_tokens: int, step_tokens: int) -> int:
    """The pages a sequence of at most ``max_kv_tokens`` KV positions holds after its prefill
    (reserved at admission): R, or fewer where the whole sequence has fewer blocks."""
    return min(window_bound(layout, step_tokens), -(-max_kv_tokens // layout.page_size))


def describe(layout: EntryLayout, step_tokens: int) -> dict:
    """A window entry's bound in numbers (stats, docs): the most pages and bytes (every layer
    and component of the entry) a sequence holds there, whatever its length."""
    pages = window_bound(layout, step_tokens)
    page_bytes = layout.num_layers * layout.components * layout.page_bytes
    return {
        "window": layout.window,
        "layers": layout.num_layers,
        "pages_per_sequence": pages,
        "bytes_per_sequence": pages * page_bytes,
    }


@dataclass(frozen=True)
class WindowPlan:
    """A prefilled sequence's pages in a sliding-window entry: the transfer fills blocks
    ``[first, first + count)`` (``EntryLayout.pages_for`` of the prompt), and the sequence
    holds ``reserve`` pages from then on (those ``count`` and spares)."""

    first: int
    count: int
    reserve: int


def plan_prefilled(
    layout: EntryLayout, prompt_tokens: int, max_tokens: int, step_tokens: int = 1
) -> WindowPlan:
    """What a sequence prefilled elsewhere holds in the window entry ``layout``: the blocks
    the transfer fills and the pages to reserve (``max_tokens``: the request's; the sequence
    has ``prompt_tokens + max_tokens - 1`` KV positions at most)."""
    first, count = layout.pages_for(prompt_tokens)
    keep = pages_to_hold(layout, prompt_tokens + max_tokens - 1, step_tokens)
    return WindowPlan(first, count, max(keep, count))


class WindowTable:
    """One sequence's pages of a sliding-window entry: ``table`` (a page per block, the
    placeholder before the window) and ``spares`` (held, mapped to no block). Every page it
    holds goes back to ``pool`` once, by :meth:`release`."""

    def __init__(self, pool: KVPool):
        if pool.layout.window <= 0:
            raise ValueError(f"entry {pool.layout.role} has no sliding window")
        self.pool = pool
        self.window, self.page_size = pool.layout.window, pool.page_size
        self.placeholder = pool.placeholder()
        self.table: list[int] = []
        self.spares: list[int] = []
        self.live_from = 0  # blocks before it map to the placeholder
        self.released = False

    @classmethod
    def prefilled(cls, pool: KVPool, prompt_tokens: int, pages: list[int]) -> WindowTable:
        """The table of a sequence whose prompt's window arrived in ``pages``: the first
        ``count`` for blocks ``[first, first + count)`` (``pages_for``), the rest spares."""
        first, count = pool.layout.pages_for(prompt_tokens)
        if len(pages) < count or len(set(pages)) != len(pages):
            raise ValueError(
                f"{prompt_tokens} prompt tokens need {count} distinct window pages (blocks "
                f"{first}..{first + count - 1}) and any spares after them, got {list(pages)}"
            )
        table = cls(pool)
        table.table = [table.placeholder] * first + list(pages[:count])
        table.spares = list(pages[count:])
        table.live_from = first
        return table

    @property
    def live(self) -> list[int]:
        """The pages mapped to a block the window still reaches (or the next forward writes)."""
        return self.table[self.live_from :]

    @property
    def held(self) -> int:
        return len(self.table) - self.live_from + len(self.spares)

    def add(self, pages: list[int]) -> None:
        """Hold ``pages`` (allocated from the pool by the caller) as spares."""
        self.spares += pages

    def prepare(self, start: int, n: int) -> list[int]:
        """The table for a forward writing positions ``[start, start + n)``: the blocks before
        its window go back to the spares, each block it writes without a page takes a spare.
        ValueError when it would read a block already given back (a forward starting before
        an earlier one's window) or when the spares run out (the engine reserved them)."""
        ps = self.page_size
        lo = max(0, start - self.window + 1) // ps
        if lo < self.live_from:
            raise ValueError(
                f"a forward from position {start} reads block {lo}, whose window page went back"
            )
        for b in range(self.live_from, min(lo, len(self.table))):
            self.spares.append(self.table[b])
            self.table[b] = self.placeholder
        self.live_from = lo
        end = -(-(start + n) // ps)
        while len(self.table) < end:
            if len(self.table) < lo:  # a block no forward ever wrote nor reads
                self.table.append(self.placeholder)
            elif self.spares:
                self.table.append(self.spares.pop())
            else:
                raise ValueError(
                    f"positions [{start}, {start + n}) need {end - lo} window pages, "
                    f"the sequence holds {self.held}"
                )
        return self.table

    def settle(self, next_start: int, keep: int) -> None:
        """After a prefill: the blocks the next forward (from ``next_start``) does not reach go
        back to the spares, and spares beyond ``keep`` pages held go back to the pool."""
        self.prepare(next_start, 0)
        self.trim(keep)

    def trim(self, keep: int) -> None:
        """Give spares back to the pool until at most ``keep`` pages are held."""
        extra = min(len(self.spares), self.held - keep)
        if extra > 0:
            back, self.spares = self.spares[:extra], self.spares[extra:]
            self.pool.free(back)

    def release(self) -> None:
        """Every page back to the pool (once: later calls do nothing)."""
        if self.released:
            return
        self.released = True
        pages = self.live + self.spares
        self.table, self.spares = [], []
        if pages:
            self.pool.free(pages)
