"""What the router knows of the prefix caches it routes to: for each prefill server, and for its
own decode server, the block hashes of the prompts it sent there (an LRU of bounded size).

It is an approximation: a server's cache also evicts, and decode's also holds the tokens it
generated. Both errors only cost a wrong guess (a request routed where less of its prefix is),
never a wrong answer: each stage's own cache decides what is reused. The hashes chain page-size
blocks as :func:`backends.runtime.prefix_cache.block_hashes` does (one per whole block).
"""

from __future__ import annotations

from collections import OrderedDict

from ...runtime.prefix_cache import block_hashes

CAPACITY = 1 << 16  # block hashes remembered per server (the newest)


class PrefixIndex:
    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def hit_blocks(self, hashes: list[bytes]) -> int:
        """How many leading blocks of a prompt (its ``hashes``) the server likely holds."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def add(self, hashes: list[bytes]) -> None:
        """The prompt went there: its blocks are the newest it holds."""
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def __len__(self) -> int:
        return len(self._blocks)


def prompt_blocks(prompt: list[int], page_size: int) -> list[bytes]:
    """The chained hashes of a prompt's whole blocks (what the indexes are keyed by)."""
    return block_hashes(prompt, page_size) if page_size > 0 else []
