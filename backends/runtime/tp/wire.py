"""Commands from rank 0 to the other ranks of a tensor-parallel runner: flat int64 buffers.

Rank 0 sends each command as the raw bytes of one int64 array over a pipe to each worker (no
pickle). Layout: ``[VERSION, op, pool_id, ...]``, then per op:

* ``MAKE_POOL``: ``num_pages, page_size, role`` (0 target, 1 draft), ``window_pages`` (the
  sliding-window entry's pages; -1: the default), ``window_id`` (the id its entry goes by in
  LAYOUT and the KV agents' pools), ``num_slots`` (a hybrid model's state slots; -1: none) and
  ``state_id`` (the id its state entry, ``pool.states``, goes by);
* ``DROP_POOL``: nothing (the pool is gone on rank 0);
* ``FORWARD`` and ``PREFILL`` (a batch of prompts, layer-grouped on rank 0):
  ``last_only, B, (start_pos, num_tokens, num_pages, num_window_pages, slot) x B, tokens...,
  pages..., window pages...`` (a sequence without window pages: -1 of them; without a state
  slot: slot -1);
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

# 2: PREFILL carries a batch like FORWARD; 3: sliding-window pages; 4: state slots
VERSION = 4
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
    num_slots: int | None = None  # MAKE_POOL: state slots (None: a model without them)
    state_id: int = 0
    last_only: bool = False  # FORWARD
    # FORWARD / PREFILL: per sequence (tokens, start_pos, pages, window pages, state slot),
    # without the trailing fields it lacks (see seq_fields)
    seqs: list[tuple] = field(default_factory=list)


def wire_seq(tokens, start: int, pages, window=None, slot: int | None = None) -> tuple:
    """A FORWARD / PREFILL sequence: ``(tokens, start, pages, window, slot)`` less its trailing
    Nones (window: its pages in the sliding-window entry; slot: its state slot)."""
    seq = (list(tokens), start, list(pages), None if window is None else list(window), slot)
    n = len(seq)
    while seq[n - 1] is None:
        n -= 1
    return seq[:n]


def seq_fields(seq: tuple) -> tuple:
    """(tokens, start, pages, window pages or None, state slot or None) of a wire sequence."""
    return (*seq, *(None,) * (5 - len(seq)))


def encode(cmd: Command) -> bytes:
    out = array("q", [VERSION, cmd.op, cmd.pool_id])
    if cmd.op == MAKE_POOL:
        window = -1 if cmd.window_pages is None else cmd.window_pages
        slots = -1 if cmd.num_slots is None else cmd.num_slots
        out.extend([cmd.num_pages, cmd.page_size, ROLES.index(cmd.role), window, cmd.window_id])
        out.extend([slots, cmd.state_id])
    elif cmd.op in (FORWARD, PREFILL):
        out.extend([int(cmd.last_only), len(cmd.seqs)])
        seqs = [seq_fields(seq) for seq in cmd.seqs]
        for tokens, start, pages, w, slot in seqs:
            out.extend([start, len(tokens), len(pages), -1 if w is None else len(w)])
            out.append(-1 if slot is None else slot)
        for tokens, *_ in seqs:
            out.extend(tokens)
        for _, _, pages, *_ in seqs:
            out.extend(pages)
        for _, _, _, w, _ in seqs:
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
        cmd.num_slots, cmd.state_id = (None if a[8] < 0 else a[8]), a[9]
    elif cmd.op in (FORWARD, PREFILL):
        cmd.last_only, B = bool(a[3]), a[4]
        heads = [a[5 + 5 * b : 10 + 5 * b] for b in range(B)]
        pos = 5 + 5 * B

        def take(n: int) -> list[int]:
            nonlocal pos
            pos += n
            return a[pos - n : pos].tolist()

        toks = [take(n) for _, n, _, _, _ in heads]
        pages = [take(n) for _, _, n, _, _ in heads]
        windows = [None if n < 0 else take(n) for _, _, _, n, _ in heads]
        for (start, *_, slot), t, p, w in zip(heads, toks, pages, windows, strict=True):
            cmd.seqs.append(wire_seq(t, start, p, w, None if slot < 0 else slot))
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
