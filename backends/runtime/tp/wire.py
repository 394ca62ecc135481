"""Commands from rank 0 to the other ranks of a tensor-parallel runner: flat int64 buffers.

Rank 0 sends each command as the raw bytes of one int64 array over a pipe to each worker (no
pickle). Layout: ``[VERSION, op, pool_id, ...]``, then per op:

* ``MAKE_POOL``: ``num_pages, page_size, role`` (0 target, 1 draft), ``window_pages`` (the
  sliding-window entry's pages; -1: the default) and ``window_id`` (the id its entry goes by in
  LAYOUT and the KV agents' pools);
* ``DROP_POOL``: nothing (the pool is gone on rank 0);
* ``FORWARD`` and ``PREFILL`` (a batch of prompts, layer-grouped on rank 0):
  ``last_only, B, (start_pos, num_tokens, num_pages, num_window_pages) x B, tokens...,
  pages..., window pages...`` (a sequence without window pages: -1 of them);
* ``STOP``: nothing;
* ``LAYOUT``: nothing; the worker answers :func:`encode_layout` of its pool's layout.

Every rank then runs the same forward; the forward's collectives keep them in step.

Why a pipe and not a ``torch.distributed`` broadcast: a worker waits for its next forward for as
long as the server idles, which no collective with a deadline can do; the pipe also carries the
worker's answers (``ok``, a layout, ``error: ...``) and gives an EOF when rank 0 dies. The bytes
are the same compact int64 encoding a broadcast would carry.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

VERSION = 3  # 2: PREFILL carries a batch like FORWARD; 3: sliding-window pages
MAKE_POOL, DROP_POOL, FORWARD, PREFILL, STOP, LAYOUT = range(1, 7)
LAYOUT_FIELDS = ("head_start", "kv_heads", "total_kv_heads", "base_addr")
ROLES = ("target", "draft")


@dataclass
class Command:
    op: int
    pool_id: int = 0
    num_pages: int = 0  # MAKE_POOL
    page_size: int = 0
    role: str = "target"
    window_pages: int | None = None  # MAKE_POOL: None: the default
    window_id: int = 0
    last_only: bool = False  # FORWARD
    # FORWARD / PREFILL: (tokens, start_pos, pages) per sequence, and its window pages after
    # them where it has some (see window_pages_of)
    seqs: list[tuple] = field(default_factory=list)


def window_pages_of(seq: tuple) -> list[int] | None:
    """A FORWARD / PREFILL sequence's pages in the sliding-window entry (None: none given)."""
    return seq[3] if len(seq) > 3 else None


def encode(cmd: Command) -> bytes:
    out = array("q", [VERSION, cmd.op, cmd.pool_id])
    if cmd.op == MAKE_POOL:
        window = -1 if cmd.window_pages is None else cmd.window_pages
        out.extend([cmd.num_pages, cmd.page_size, ROLES.index(cmd.role), window, cmd.window_id])
    elif cmd.op in (FORWARD, PREFILL):
        out.extend([int(cmd.last_only), len(cmd.seqs)])
        windows = [window_pages_of(seq) for seq in cmd.seqs]
        for (tokens, start, pages, *_), w in zip(cmd.seqs, windows, strict=True):
            out.extend([start, len(tokens), len(pages), -1 if w is None else len(w)])
        for tokens, *_ in cmd.seqs:
            out.extend(tokens)
        for _, _, pages, *_ in cmd.seqs:
            out.extend(pages)
        for w in windows:
            out.extend(w or [])
    return out.tobytes()


def decode(buf: bytes) -> Command:
    a = array("q")
    a.frombytes(buf)
    if len(a) < 3 or a[0] != VERSION:
        got = a[0] if a else None
        raise ValueError(f"tensor-parallel command of version {got}, want {VERSION}")
    cmd = Command(op=a[1], pool_id=a[2])
    if cmd.op == MAKE_POOL:
        cmd.num_pages, cmd.page_size, cmd.role = a[3], a[4], ROLES[a[5]]
        cmd.window_pages, cmd.window_id = (None if a[6] < 0 else a[6]), a[7]
    elif cmd.op in (FORWARD, PREFILL):
        cmd.last_only, B = bool(a[3]), a[4]
        heads = [a[5 + 4 * b : 9 + 4 * b] for b in range(B)]
        pos = 5 + 4 * B

        def take(n: int) -> list[int]:
            nonlocal pos
            pos += n
            return a[pos - n : pos].tolist()

        toks = [take(n) for _, n, _, _ in heads]
        pages = [take(n) for _, _, n, _ in heads]
        windows = [None if n < 0 else take(n) for _, _, _, n in heads]
        for (start, *_), t, p, w in zip(heads, toks, pages, windows, strict=True):
            cmd.seqs.append((t, start, p) if w is None else (t, start, p, w))
    elif cmd.op not in (DROP_POOL, STOP, LAYOUT):
        raise ValueError(f"unknown tensor-parallel command {cmd.op}")
    return cmd


def encode_layout(layout) -> bytes:
    """A worker's answer to LAYOUT: the fields of its EntryLayout that differ between ranks."""
    return array("q", [getattr(layout, f) for f in LAYOUT_FIELDS]).tobytes()


def decode_layout(buf: bytes) -> dict[str, int]:
    a = array("q")
    a.frombytes(buf)
    if len(a) != len(LAYOUT_FIELDS):
        raise ValueError(f"layout answer of {len(a)} fields, want {len(LAYOUT_FIELDS)}")
    return dict(zip(LAYOUT_FIELDS, a.tolist(), strict=True))
