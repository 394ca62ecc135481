"""Block hashes: the prefix cache's keys, and the ids its KV events name.

A *block* is the ``P`` tokens one KV page holds (``P`` = the pool's page size), starting at a
multiple of ``P``; only full blocks have a hash. Block ``i``'s hash chains over every token before
it, as vLLM's ``hash_block_tokens`` does (``H(parent hash, block tokens)``)::

    h_-1 = SHA-256(b"pd-triton prefix cache v1" || salt)                  (root_hash(salt))
    h_i  = SHA-256(h_{i-1} || uint32-LE(tokens[i*P : (i+1)*P]))           (chain)

so two sequences share block ``i``'s hash only when they share all of tokens ``[0, (i+1)*P)``
(up to SHA-256 collisions), never just one block's tokens. ``salt`` separates what must not
share KV though its tokens agree (another LoRA adapter, another model); the pool of one model
needs none. The hashes are the same in every process (no per-process seed), so a router can
compute a prompt's hashes itself and compare them with what a server published.

Events carry :func:`external`: the digest's low 64 bits as an unsigned int, which is what vLLM
sends by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``: ``int.from_bytes(h, "big") &
(2**64 - 1)``). Consumers such as llm-d's indexer and Dynamo's router treat them as opaque ids
linked by ``parent_block_hash`` and carry the blocks' token ids alongside.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Sequence

HASH_VERSION = b"pd-triton prefix cache v1"
_MASK64 = (1 << 64) - 1


def root_hash(salt: bytes = b"") -> bytes:
    """The parent hash of a sequence's first block."""
    return hashlib.sha256(HASH_VERSION + salt).digest()


def chain(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The hash of a block holding ``tokens`` whose preceding block's hash is ``parent``."""
    return hashlib.sha256(parent + struct.pack(f"<{len(tokens)}I", *tokens)).digest()


def iter_block_hashes(
    token_ids: Sequence[int], page_size: int, parent: bytes, start_block: int = 0
) -> Iterator[bytes]:
    """Hashes of the full blocks of ``token_ids`` from block ``start_block`` on, lazily (a
    lookup stops hashing at its first miss); ``parent`` is block ``start_block - 1``'s hash
    (the root for block 0)."""
    for i in range(start_block, len(token_ids) // page_size):
        parent = chain(parent, token_ids[i * page_size : (i + 1) * page_size])
        yield parent


def block_hashes(token_ids: Sequence[int], page_size: int, salt: bytes = b"") -> list[bytes]:
    """Every full block's hash of ``token_ids`` (a router's view of a prompt)."""
    return list(iter_block_hashes(token_ids, page_size, root_hash(salt)))


def external(block_hash: bytes) -> int:
    """The id a KV event carries for a block: the digest's low 64 bits (as vLLM sends them)."""
    return int.from_bytes(block_hash, "big") & _MASK64
