"""Paged attention over a KV pool, batched across sequences of different lengths.

A forward pass takes ``T`` new tokens flattened over ``B`` sequences ("varlen"). Sequence ``b``
adds ``n_b`` tokens at positions ``[start_b, start_b + n_b)`` and attends to its whole context
``[0, start_b + n_b)``, whose KV lives in its pages. :class:`BatchMeta` is built once per forward
and shared by every layer (plain Python over the new tokens, a tensor op for the context's
slots: a decode step's batch is a handful of small lists, where each tensor op's fixed cost
would dominate):

* ``write_slots [T]``: flat pool slot (``page * page_size + offset``) of each new token;
* ``read_slots [B, L]``: flat slots of each sequence's context, padded to the longest ``L``;
* ``mask``: causal + padding (+ sliding window), only where a kernel needs one;
* ``q_index [T]``: where each flat token sits in the padded ``[B * Q]`` query grid;
* ``copies``: slots each layer copies after writing, before attending: an input that follows
  another input's first new tokens (``SeqInput.root``) gets their KV in its own pages.

Three kinds of forward, picked once per batch (:attr:`BatchMeta.kind`):

* ``prefill``: every sequence starts at position 0, so its context is exactly its new tokens:
  attention runs on the new K/V directly and never reads the pool back;
* ``decode``: one new token per sequence: queries need no padding;
* ``extend``: anything else (prefill continuation, speculative verify, draft catch-up).

Pool reads (``extend``, and ``decode`` where no in-place kernel runs) go through
:func:`gather_context`: one ``index_select`` per layer component on the pool viewed as 2-D
``[slots, Hkv * D]`` rows (measured 37x faster than the same select on the 3-D view, 0.2 ms vs
8 ms for 4.6k slots of SmolLM2). On CPU, decode reads the pages in place instead, with the
runtime's C++ kernel (:mod:`backends.runtime.decode_attn`); ``key_bounds`` is its view of the
mask. On CUDA every kind reads the pages in place through ``page_table`` with the Triton kernel
(:mod:`backends.runtime.triton_attn`; ``starts`` and ``cu_q`` are its view of the batch).

Layers with different windows (Gemma 3, gpt-oss: sliding and full layers interleaved) share one
batch: the runner builds it without a window and each layer attends through
:meth:`BatchMeta.for_window` (built once per forward and window). A windowed view reads only the
keys its window reaches: its ``read_slots`` start, per sequence, at the first key the sequence's
first new token sees (``key_base``), and its ``mask`` / ``key_bounds`` are relative to that; the
C++ kernels and the Triton kernel start their key loops at the window. So the pages before a
sequence's window are never read by a sliding layer, and a model that mixes sliding and full
layers keeps its sliding layers' KV in a pool entry of its own, where a sequence holds only its
window's pages (:mod:`backends.runtime.window`): the runner builds a second batch over those
page tables (:meth:`BatchMeta.with_pages`, as ``window_batch``), and the sliding layers attend
through its windowed views.

Attention sinks (gpt-oss): ``sinks`` [H], one learned logit per query head that joins every
softmax's denominator and adds no value: ``out = sum_j e^(s_j) v_j / (e^sink + sum_j e^(s_j))``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

import torch
import torch.nn.functional as F

from .kv_quant import dequantize, is_fp8, write_rows
from .recurrent.batch import RecurrentBatch


@dataclass
class SeqInput:
    """New tokens of one sequence: written at positions [start_pos, start_pos + len), their KV
    into ``pages`` (the sequence's whole page table). A forward takes a list of these and builds
    one :class:`BatchMeta` from their ``(start_pos, len(token_ids), pages)``."""

    token_ids: list[int]
    start_pos: int
    pages: list[int] = field(default_factory=list)
    slot: int | None = None  # its state slot (a model with recurrent layers; see state_pool)
    # a model with a sliding-window entry (pool.window): its page table there, one page per
    # block, out-of-window blocks on the placeholder (window.WindowTable.table). None: the same
    # page ids as ``pages`` (a caller holding every block in both entries, while nothing else
    # holds a page of pool.window)
    window_pages: list[int] | None = None
    # the index, in the same forward, of an input whose first new tokens this one follows: the
    # root's tokens at positions before this ``start_pos`` (at least its first), whose KV is
    # written into this input's pages too, so this input does not feed them again (a draft
    # chain verified beside the sequence's own, spec_branches). None: its context is all in
    # its pages already
    root: int | None = None


@dataclass
class BatchMeta:
    kind: str  # "prefill" | "decode" | "extend"
    positions: torch.Tensor  # [T] absolute position of each new token
    write_slots: torch.Tensor  # [T]
    read_slots: torch.Tensor  # [B, L]
    ctx_lens: torch.Tensor  # [B] context length after this forward
    q_index: torch.Tensor  # [T] index into the padded [B * Q] grid
    mask: torch.Tensor | None  # [B, 1, Q, L] bool, True = attend; None: see `causal`
    lengths: list[int]  # new tokens per sequence
    num_seqs: int
    max_q: int
    causal: bool = False  # mask is None and attention is plain causal (prefill from 0)
    window: int | None = None  # sliding window, keys per query
    page_size: int = 0
    page_table: torch.Tensor | None = None  # [B, P] int32 pages of each sequence (padded: 0)
    starts: torch.Tensor | None = None  # [B] int32 position of each sequence's first new token
    # a windowed view (for_window): [B] position of each sequence's read_slots column 0
    key_base: torch.Tensor | None = None
    # a model with recurrent layers: each sequence's state slot (set by the runner)
    recurrent: RecurrentBatch | None = None
    # a model with a sliding-window entry: the same tokens over its page tables there
    # (with_pages; set by the runner), which the sliding layers attend through
    window_batch: BatchMeta | None = None
    # (src [C], dst [C]) slots each layer copies in its pool after writing the new KV and
    # before attending: a root's first tokens into the inputs that follow them (SeqInput.root;
    # root_copies, set by the runner). None: no copies
    copies: tuple[torch.Tensor, torch.Tensor] | None = None
    views: dict = field(default_factory=dict, repr=False, compare=False)  # window -> view

    @classmethod
    def build(
        cls,
        seqs: list[tuple[int, int, list[int]]],
        page_size: int,
        num_pages: int,
        device,
        sliding_window: int | None = None,
    ) -> BatchMeta:
        """seqs: (start_pos, num_new_tokens, pages) per sequence."""
        starts, lengths, table = _check_and_table(seqs, page_size, num_pages)
        B, max_q = len(seqs), max(lengths)
        ctx = [s + n for s, n in zip(starts, lengths, strict=True)]
        if all(s == 0 for s in starts):
            kind = "prefill"
        else:
            kind = "decode" if max_q == 1 else "extend"
        starts_t, ctx_t = torch.tensor(starts), torch.tensor(ctx)
        mask, causal = _mask(kind, starts_t, ctx_t, max_q, sliding_window)
        q_index = [b * max_q + j for b, n in enumerate(lengths) for j in range(n)]
        return cls(
            kind=kind,
            positions=torch.tensor(_positions(starts, lengths), device=device),
            write_slots=torch.tensor(_write_slots(seqs, page_size), device=device),
            read_slots=_read_slots(table, max(ctx), page_size).to(device),
            ctx_lens=ctx_t.to(device),
            q_index=torch.tensor(q_index, device=device),
            mask=None if mask is None else mask.to(device),
            lengths=lengths,
            num_seqs=B,
            max_q=max_q,
            causal=causal,
            window=sliding_window,
            page_size=page_size,
            page_table=table.to(device=device, dtype=torch.int32),
            starts=starts_t.to(device=device, dtype=torch.int32),
        )

    def with_pages(self, seqs: list[tuple[int, int, list[int]]], num_pages: int) -> BatchMeta:
        """The same batch over another entry's page tables: ``seqs`` as for :meth:`build`
        (the same starts and lengths, that entry's pages). Only the slots and the page table
        differ; built without a window, as :meth:`build`."""
        starts, lengths, table = _check_and_table(seqs, self.page_size, num_pages)
        if lengths != self.lengths:
            raise ValueError("a batch over other pages must have the same sequences")
        L = max(s + n for s, n in zip(starts, lengths, strict=True))
        device = self.positions.device
        return replace(
            self,
            write_slots=torch.tensor(_write_slots(seqs, self.page_size), device=device),
            read_slots=_read_slots(table, L, self.page_size).to(device),
            page_table=table.to(device=device, dtype=torch.int32),
            recurrent=None,
            window_batch=None,
            views={},
        )

    def for_window(self, window: int | None) -> BatchMeta:
        """This batch as a layer whose queries see ``window`` keys (None: all) attends over it:
        itself when the windows agree, else a view built once (see the module docstring)."""
        if window == self.window:
            return self
        view = self.views.get(window)
        if view is None:
            if self.key_base is not None:
                raise ValueError("a window view is built from the batch, not from another view")
            view = self.views[window] = _window_view(self, window)
        return view

    @cached_property
    def cu_seqlens(self) -> torch.Tensor:
        """[B + 1] int64 on the CPU: sequence b's new tokens are flat tokens [cu[b], cu[b+1])."""
        return torch.tensor([0, *self.lengths]).cumsum(0)

    @cached_property
    def last_rows(self) -> torch.Tensor:
        """[B] int64 on the batch's device: each sequence's last flat token."""
        return (self.cu_seqlens[1:] - 1).to(self.positions.device)

    @cached_property
    def cu_q(self) -> torch.Tensor:
        """``cu_seqlens`` as [B + 1] int32 on the batch's device (the Triton kernel's view)."""
        return self.cu_seqlens.to(device=self.positions.device, dtype=torch.int32)

    @cached_property
    def key_valid(self) -> torch.Tensor:
        """Decode batches: [B, L] bool, True where a sequence's one query sees the key."""
        if self.mask is not None:
            return self.mask[:, 0, 0, :]
        return torch.ones(self.read_slots.shape, dtype=torch.bool, device=self.read_slots.device)

    @cached_property
    def key_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each new token as a query of its own: (lo [T], hi [T]) int64, token t (at position
        p) sees keys [lo_t, hi_t) = [max(0, p + 1 - window), p + 1) of its sequence's row of
        ``read_slots`` (``token_slots``)."""
        hi = self.positions.to(torch.int64) + 1
        lo = torch.zeros_like(hi) if self.window is None else (hi - self.window).clamp(min=0)
        if self.key_base is not None:  # a windowed view: columns start at key_base
            base = self.key_base[self.seq_of_token]
            return lo - base, hi - base
        return lo, hi

    @cached_property
    def seq_of_token(self) -> torch.Tensor:
        """[T] int64: the sequence of each new token."""
        return torch.div(self.q_index, self.max_q, rounding_mode="floor")

    @cached_property
    def token_slots(self) -> torch.Tensor:
        """[T, L]: each new token's row of ``read_slots`` (a decode batch: ``read_slots``)."""
        if self.max_q == 1:
            return self.read_slots
        return self.read_slots[self.seq_of_token]


def _check_and_table(
    seqs: list[tuple[int, int, list[int]]], page_size: int, num_pages: int
) -> tuple[list[int], list[int], torch.Tensor]:
    """-> (starts, new-token counts, page table [B, P] of the blocks each sequence reaches,
    padded with page 0)."""
    if not seqs:
        raise ValueError("a forward needs at least one sequence")
    rows = []
    for b, (start, n, pages) in enumerate(seqs):
        if n <= 0:
            raise ValueError(f"sequence {b} has no new tokens")
        need = -(-(start + n) // page_size)
        if len(pages) < need:
            raise ValueError(
                f"sequence {b}: {start + n} tokens need {need} pages of {page_size}, "
                f"got {len(pages)}"
            )
        rows.append(list(pages[:need]))
        if min(rows[-1]) < 0 or max(rows[-1]) >= num_pages:
            bad = [p for p in rows[-1] if not 0 <= p < num_pages]
            raise IndexError(f"sequence {b}: pages {bad} outside the pool [0, {num_pages})")
    width = max(map(len, rows))
    table = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    return [s for s, _, _ in seqs], [n for _, n, _ in seqs], table


def _positions(starts: list[int], lengths: list[int]) -> list[int]:
    """Each new token's position, sequence after sequence."""
    return [p for s, n in zip(starts, lengths, strict=True) for p in range(s, s + n)]


def _write_slots(seqs: list[tuple[int, int, list[int]]], page_size: int) -> list[int]:
    """Each new token's flat slot through its sequence's pages."""
    return [
        pages[p // page_size] * page_size + p % page_size
        for start, n, pages in seqs
        for p in range(start, start + n)
    ]


def _read_slots(table: torch.Tensor, L: int, page_size: int) -> torch.Tensor:
    """table [B, P] -> [B, L]: each sequence's context slots through its page table, padded to
    the longest context ``L`` (past a sequence's own: slots of page 0)."""
    B, P = table.shape
    slots = (table * page_size)[:, :, None] + torch.arange(page_size)  # [B, P, page_size]
    return slots.view(B, P * page_size)[:, :L].contiguous()


def _mask(
    kind: str, starts: torch.Tensor, ctx: torch.Tensor, max_q: int, window: int | None
) -> tuple[torch.Tensor | None, bool]:
    """-> (mask [B, 1, Q, L] or None, plain causal). Keys: context ([0, L)), or for a prefill
    batch the new tokens themselves (the same positions)."""
    L = int(ctx.max())
    dev = starts.device
    windowed = window is not None and window < L
    if kind == "prefill" and not windowed:
        # every sequence starts at 0 and is right-padded: a real query at position i sees keys
        # [0, i], all real, so plain causal attention needs no mask (SDPA then skips the blocks
        # above the diagonal; padded queries' rows are dropped by `unpad`)
        return None, True
    if kind == "decode" and not windowed and bool((ctx == L).all()):
        return None, False  # every query sees its whole (equal-length) context
    k_pos = torch.arange(L, device=dev)[None, None, :]  # [1, 1, L]
    return _key_mask(starts, ctx, max_q, k_pos, window if windowed else None), False


def _key_mask(starts, ctx, max_q: int, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[B, 1, Q, L] bool: query q of sequence b (at starts[b] + q) sees the key at position
    k_pos[b or 0, 0, l]."""
    q_pos = starts[:, None] + torch.arange(max_q, device=starts.device)[None, :]  # [B, Q];
    q_pos = torch.minimum(q_pos, ctx[:, None] - 1)  # padding rows clamped: none fully masked
    mask = (k_pos <= q_pos[:, :, None]) & (k_pos < ctx[:, None, None])
    if window is not None:
        mask &= k_pos > q_pos[:, :, None] - window
    return mask[:, None]


def _window_view(meta: BatchMeta, window: int | None) -> BatchMeta:
    """``meta`` as a layer with ``window`` sees it. A prefill batch reads no pool: only its mask
    changes. Otherwise, with a window, each sequence's keys start at the first one its first
    new token sees, ``key_base[b] = max(0, start_b - window + 1)``: ``read_slots`` [B, S] (S the
    longest span; columns past a sequence's context repeat its last slot, masked) and the mask
    are relative to it. Built with device ops (one host sync: S)."""
    starts, ctx = meta.starts.long(), meta.ctx_lens
    if window is None or meta.kind == "prefill":
        mask, causal = _mask(meta.kind, starts, ctx, meta.max_q, window)
        view = replace(meta, window=window, mask=mask, causal=causal, views={})
    else:
        base = (starts - window + 1).clamp(min=0)  # [B]
        span = int((ctx - base).max())
        cols = base[:, None] + torch.arange(span, device=base.device)[None, :]  # [B, S]
        read = meta.read_slots.gather(1, torch.minimum(cols, ctx[:, None] - 1))
        mask = _key_mask(starts, ctx, meta.max_q, cols[:, None, :], window)
        view = replace(
            meta, window=window, read_slots=read, mask=mask, causal=False, key_base=base, views={}
        )
    for name in ("cu_seqlens", "cu_q", "last_rows", "seq_of_token"):  # the window's not in them
        if name in meta.__dict__:
            view.__dict__[name] = meta.__dict__[name]
    return view


def root_copies(seqs: list[SeqInput], page_size: int, device):
    """(src [C], dst [C]) slots on ``device`` for the inputs with a root (:attr:`SeqInput.root`):
    for each position the input shares (the root's new tokens before its ``start_pos``), the
    root's slot of it and the input's own; None when no input has a root. The page tables were
    checked by :meth:`BatchMeta.build` (their blocks up to each input's end)."""
    src, dst = [], []
    for b, s in enumerate(seqs):
        if s.root is None:
            continue
        r = s.root
        if not 0 <= r < len(seqs) or r == b or seqs[r].root is not None:
            raise ValueError(f"input {b}: root {r} is not another input without a root")
        first, end = seqs[r].start_pos, seqs[r].start_pos + len(seqs[r].token_ids)
        if not first < s.start_pos <= end:
            raise ValueError(
                f"input {b} starts at {s.start_pos}: it must follow one of its root's new "
                f"tokens, at positions [{first}, {end})"
            )
        for pos in range(first, s.start_pos):
            for pages, out in ((seqs[r].pages, src), (s.pages, dst)):
                out.append(pages[pos // page_size] * page_size + pos % page_size)
    if not src:
        return None
    return torch.tensor(src, device=device), torch.tensor(dst, device=device)


def copy_slots(cache: torch.Tensor, meta: BatchMeta) -> None:
    """cache: [S, ...] flat slots of one layer component, the batch's new KV written: copy the
    slots of ``meta.copies`` (an fp8 cache as bytes)."""
    if meta.copies is None:
        return
    src, dst = meta.copies
    rows = cache.view(cache.shape[0], -1)
    if is_fp8(rows):
        rows = rows.view(torch.uint8)
    rows.index_copy_(0, dst, rows.index_select(0, src))


def write_kv(cache: torch.Tensor, meta: BatchMeta, new: torch.Tensor, scale=None) -> None:
    """cache: [S, ...] flat slots of one layer component; new: [T, ...] for meta.write_slots
    (an fp8 cache: quantized with ``scale``)."""
    write_rows(cache, meta.write_slots, new, scale)


def gather_context(cache: torch.Tensor, meta: BatchMeta, scale=None, dtype=None):
    """cache: [S, Hkv, D] (contiguous rows) -> each sequence's context [B, Hkv, L, D] (an fp8
    cache: dequantized with ``scale`` to ``dtype``)."""
    S, Hkv, D = cache.shape
    B, L = meta.read_slots.shape
    rows = cache.reshape(S, Hkv * D).index_select(0, meta.read_slots.reshape(-1))
    if is_fp8(rows):
        rows = dequantize(rows, scale, dtype)
    return rows.view(B, L, Hkv, D).transpose(1, 2)


def pad_queries(x: torch.Tensor, meta: BatchMeta) -> torch.Tensor:
    """x: [T, H, D] flat tokens -> [B, H, Q, D] padded grid (zeros in the padding)."""
    T, H, D = x.shape
    if meta.num_seqs == 1:
        return x.transpose(0, 1)[None]
    grid = x.new_zeros(meta.num_seqs * meta.max_q, H, D)
    grid.index_copy_(0, meta.q_index, x)
    return grid.view(meta.num_seqs, meta.max_q, H, D).transpose(1, 2)


def unpad(out: torch.Tensor, meta: BatchMeta) -> torch.Tensor:
    """out: [B, H, Q, Dv] -> [T, H, Dv] for the real tokens."""
    B, H, Q, Dv = out.shape
    flat = out.transpose(1, 2).reshape(B * Q, H, Dv)
    if B == 1 and Q == len(meta.q_index):
        return flat
    return flat.index_select(0, meta.q_index)


def paged_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    k_cache: torch.Tensor,
    meta: BatchMeta,
    scale: float,
    v_new: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    v_dim: int | None = None,
    kv_scales: tuple[float, ...] = (1.0, 1.0),
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of new tokens over their sequences' context (the new tokens included).

    q: [T, H, Dk]; k_new: [T, Hkv, Dk] (already written to the cache); k_cache: [S, Hkv, Dk]
    flat slots. Values: v_new [T, Hkv, Dv] and v_cache [S, Hkv, Dv], or none of them and
    ``v_dim``: the values are the keys' first ``v_dim`` channels (MLA's latent). -> [T, H, Dv].
    H must be a multiple of Hkv (GQA; MLA in latent space has Hkv = 1). ``kv_scales``: the
    (K, V) scales of fp8 caches (a prefill reads no cache: its caller passes the new K/V as
    the pool stores them, see :func:`~backends.runtime.kv_quant.as_stored`). ``sinks``: [H]
    float32 sink logits, or None.
    """
    H = q.shape[1]
    if meta.kind == "prefill":  # the context is the new tokens: no pool reads
        k = pad_queries(k_new, meta)  # [B, Hkv, Q, Dk]
        v = k[..., :v_dim] if v_new is None else pad_queries(v_new, meta)
    else:
        k = gather_context(k_cache, meta, kv_scales[0], q.dtype)  # [B, Hkv, L, Dk]
        if v_cache is None:
            v = k[..., :v_dim]
        else:
            v = gather_context(v_cache, meta, kv_scales[-1], q.dtype)
    if sinks is not None:  # SDPA has no sink: the softmax written out
        qp = q[:, :, None] if meta.kind == "decode" else pad_queries(q, meta)
        out = _attention_with_sinks(qp, k, v, meta.mask, meta.causal, scale, sinks)
        return out[:, :, 0] if meta.kind == "decode" else unpad(out, meta)
    if meta.kind == "decode":
        return _decode_sdpa(q, k, v, meta.mask, scale)
    qp = pad_queries(q, meta)  # [B, H, Q, Dk]
    out = F.scaled_dot_product_attention(
        qp,
        k,
        v,
        attn_mask=meta.mask,
        is_causal=meta.causal,
        scale=scale,
        enable_gqa=k.shape[1] != H,
    )  # [B, H, Q, Dv]
    return unpad(out, meta)


def _attention_with_sinks(q, k, v, mask, causal: bool, scale: float, sinks) -> torch.Tensor:
    """q: [B, H, Q, Dk]; k: [B, Hkv, L, Dk]; v: [B, Hkv, L, Dv]; mask: [B, 1, Q, L] or None
    (``causal``: plain causal; else every key); sinks: [H] -> [B, H, Q, Dv] in q's dtype.
    Float32 scores and softmax with each head's sink logit in the denominator."""
    B, H, Q, _ = q.shape
    G = H // k.shape[1]
    kf, vf = k.float().repeat_interleave(G, 1), v.float().repeat_interleave(G, 1)  # [B, H, L, D]
    s = (q.float() @ kf.transpose(-1, -2)) * scale  # [B, H, Q, L]
    if mask is None and causal:
        mask = torch.ones(Q, s.shape[-1], dtype=torch.bool, device=s.device).tril()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, H, 1, 1)
    m = torch.maximum(s.amax(-1, keepdim=True), sink)  # finite: the sink is
    p = torch.exp(s - m)
    p = p / (p.sum(-1, keepdim=True) + torch.exp(sink - m))
    return (p @ vf).to(q.dtype)


def _decode_sdpa(q, k, v, mask, scale) -> torch.Tensor:
    """One query per sequence. The G = H / Hkv query heads that share a KV head go to SDPA as
    G queries of that head ([B, Hkv, G, Dk]: q's heads are grouped that way), so each K/V row is
    read once per KV head, not once per query head. mask: None or [B, 1, 1, L], the same for
    the G queries. -> [B, H, Dv]."""
    B, H, Dk = q.shape
    Hkv = k.shape[1]
    out = F.scaled_dot_product_attention(
        q.view(B, Hkv, H // Hkv, Dk), k, v, attn_mask=mask, scale=scale
    )  # [B, Hkv, G, Dv]
    return out.reshape(B, H, -1)
