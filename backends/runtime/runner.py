"""ModelRunner: run prefill / batched extend / decode of one model over a paged KV pool.

No scheduling here (see :mod:`backends.runtime.engine`); the runner only turns (tokens, positions,
pages) into logits and KV writes.

A pool's entries (:meth:`ModelRunner.make_pool`): the model's KV (``target`` / ``draft``); for a
model mixing sliding-window and full layers also ``pool.window`` (its sliding layers, of which a
sequence holds only its window's pages: ``SeqInput.window_pages``, :mod:`backends.runtime.window`);
for a model with recurrent layers ``pool.states`` (a slot per sequence: ``SeqInput.slot``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from kvtransfer import EntryLayout

from .config import ModelConfig
from .cuda_graphs import DecodeGraphs, graphs_requested
from .kv_pool import KVPool, OutOfPagesError
from .model import CausalLM
from .paged import BatchMeta, SeqInput, root_copies
from .recurrent.batch import RecurrentBatch
from .state_pool import DEFAULT_SLOTS, StatePool, StateSpec

log = logging.getLogger(__name__)


class ModelRunner:
    """One model on one device (a checkpoint is loaded into one by
    :func:`~backends.runtime.loader.load_runner`).

    ``graphs``: whether decode may replay CUDA graphs where the model and device allow them
    (:attr:`use_graphs`). The loader asks for them for a single-rank model, and a self-draft
    for its target's layers; a tensor-parallel rank never does (a replayed step would run rank
    0's shard without the other ranks), nor an EAGLE head (its own forward).
    """

    # its pools' tensors are all of their KV (KVPool.copy_page copies a page); a
    # tensor-parallel runner's pools are sharded over its ranks' processes
    local_pools = True

    def __init__(
        self, config: ModelConfig, model: CausalLM, dtype: str, device: str, graphs: bool = False
    ):
        self.config = config
        self.model = model
        self.dtype = dtype
        self.kv_dtype = dtype  # the pool's dtype: the model's, or fp8 (see set_kv_cache)
        self.kv_scale_log2: tuple[int, ...] = ()  # fp8: per (layer, component) scale exponents
        self.device = torch.device(device)
        # decode steps from CUDA graphs (unless PD_RUNTIME_CUDA_GRAPHS=0; GQA models on CUDA
        # with the Triton attention); tests may set use_graphs / graph_factory to run them on CPU
        self.use_graphs = (
            graphs
            and graphs_requested()
            and self.device.type == "cuda"
            and config.attn == "gqa"
            and not config.has_recurrent_state  # the graphs hold no state slots
            # the graphs' step buffers serve the Triton kernel only, not gather + SDPA
            and model.kernels.attention in ("auto", "triton")
        )
        self.graph_factory = None
        self._graphs: dict[int, DecodeGraphs | None] = {}

    def set_kv_cache(self, kv_dtype: str, scale_log2: tuple[int, ...]) -> None:
        """Store this model's KV as ``kv_dtype`` with these scales (fp8; pools made later)."""
        comps = 2 if self.config.attn == "gqa" else 1
        if len(scale_log2) != self.config.num_layers * comps:
            raise ValueError(f"{len(scale_log2)} KV scales for {self.config.num_layers} layers")
        self.kv_dtype, self.kv_scale_log2 = kv_dtype, tuple(scale_log2)
        for i, layer in enumerate(self.model.layers):
            layer.attn.kv_scales = tuple(2.0**e for e in scale_log2[i * comps : (i + 1) * comps])

    # ---- KV pool -----------------------------------------------------------------------------
    def entry_layout(self, num_pages: int, page_size: int, role: str = "target") -> EntryLayout:
        """The layout of this model's entry ``role``: ``target`` / ``draft`` (its attention
        layers, or with a sliding-window entry its full-attention ones), or that entry's
        ``.window`` (``config.window_kv_layers``, with the window)."""
        c = self.config
        windowed = role.endswith(".window")
        layers = c.window_kv_layers if windowed else c.full_kv_layers
        if not layers:
            raise ValueError(f"this model has no {role} entry")
        if c.attn == "gqa":  # per token and layer: K and V of every KV head
            shape = dict(kv_heads=c.num_kv_heads, head_dim=c.head_dim)
        else:  # per token and layer: one latent [c_kv | k_pe]
            rank, rope = c.kv_lora_rank, c.qk_rope_head_dim
            shape = dict(kv_heads=1, head_dim=rank + rope, kv_lora_rank=rank, rope_dim=rope)
        scales = self.kv_scale_log2
        if scales and len(layers) != c.num_layers:  # this entry's layers' scales
            comps = len(scales) // c.num_layers
            scales = tuple(scales[i * comps + k] for i in layers for k in range(comps))
        return EntryLayout(
            role=role,
            attn=c.attn,
            dtype=self.kv_dtype,
            scale_log2=scales,
            page_size=page_size,
            num_layers=len(layers),  # a hybrid's attention layers only
            num_pages=num_pages,
            window=c.sliding_window if windowed else 0,
            **shape,
        )

    def make_pool(
        self,
        num_pages: int,
        page_size: int,
        role: str = "target",
        num_slots: int | None = None,
        window_pages: int | None = None,
    ) -> KVPool:
        """A KV pool of ``num_pages`` pages; for a model with recurrent layers also its state
        slots (``pool.states``): ``num_slots``, by default ``min(num_pages, DEFAULT_SLOTS)`` (a
        sequence holds a page too, so more slots than pages never serve). A model mixing
        sliding-window and full layers also gets its sliding layers' entry (``pool.window``,
        role ``{role}.window``) of ``window_pages`` pages (default ``num_pages``: whatever fits
        the full layers' pages fits; a sequence holds far fewer there, see window.py)."""
        states = None
        if self.state_spec() is not None:
            slots = num_slots if num_slots is not None else min(num_pages, DEFAULT_SLOTS)
            states = self.state_pool(slots, role)
        window = None
        if self.config.window_kv_layers:
            n = num_pages if window_pages is None else window_pages
            window = KVPool(self.entry_layout(n, page_size, f"{role}.window"), self.device)
        elif window_pages is not None:
            raise ValueError("window_pages: this model has no sliding-window entry")
        layout = self.entry_layout(num_pages, page_size, role)
        return KVPool(layout, self.device, states, window)

    def state_spec(self) -> StateSpec | None:
        """What a state slot of this model holds (None: no recurrent layers)."""
        return StateSpec.of(self.config)

    def state_pool(self, num_slots: int, role: str = "target") -> StatePool:
        """``num_slots`` state slots of this model (its pool's ``states``)."""
        return StatePool(self.state_spec(), num_slots, self.device, role)

    def _check_pool(self, pool: KVPool) -> None:
        want = self.entry_layout(pool.num_pages, pool.page_size, pool.layout.role).signature()
        if pool.layout.signature() != want:
            raise ValueError(f"pool layout {pool.layout.signature()} does not fit this model")
        window = pool.window
        if (window is not None) != bool(self.config.window_kv_layers):
            raise ValueError(
                f"pool {'has' if window is not None else 'lacks'} a sliding-window entry: "
                f"it does not fit this model"
            )
        if window is not None:
            role = f"{pool.layout.role}.window"
            want = self.entry_layout(window.num_pages, window.page_size, role).signature()
            if window.layout.signature() != want:
                raise ValueError(f"pool window layout {window.layout.signature()} does not fit")
        spec = self.state_spec()
        if (pool.states.spec if pool.states is not None else None) != spec:
            raise ValueError(f"pool state slots do not fit this model (it needs {spec})")

    def _meta(
        self,
        pool: KVPool,
        seqs: list[tuple[int, int, list[int]]],
        slots: list[int | None] | None = None,
        window_tables: list[list[int] | None] | None = None,
    ) -> BatchMeta:
        """The batch's metadata; ``slots``: each sequence's state slot (a model with recurrent
        layers needs them, each held: allocated from ``pool.states``). A pool with a
        sliding-window entry: ``window_tables``, each sequence's page table there (None: its
        ``pages``, while nothing holds a page of ``pool.window``)."""
        limit = self.config.max_position_embeddings
        for start, n, _ in seqs:
            if start < 0 or start + n > limit:
                raise ValueError(
                    f"positions [{start}, {start + n}) outside [0, {limit}) "
                    f"(max_position_embeddings)"
                )
        # no window here: each layer attends through meta.for_window(its own window)
        meta = BatchMeta.build(seqs, pool.page_size, pool.num_pages, self.device)
        if pool.window is not None:
            meta.window_batch = _window_batch(meta, pool.window, seqs, window_tables)
        elif window_tables is not None and any(t is not None for t in window_tables):
            raise ValueError("window pages given but this model has no sliding-window entry")
        if pool.states is not None:
            slots = slots or [None] * len(seqs)
            bad = [b for b, s in enumerate(slots) if s is None or not pool.states.holds(s)]
            if bad:
                raise ValueError(
                    f"sequences {bad} hold no state slot of this pool (a model with recurrent "
                    f"layers needs one per sequence: pool.states.alloc())"
                )
            if len(set(slots)) != len(slots):
                raise ValueError(f"two sequences of one batch share a state slot: {slots}")
            starts, lengths = [s for s, _, _ in seqs], [n for _, n, _ in seqs]
            meta.recurrent = RecurrentBatch.build(pool.states.slabs, slots, starts, lengths)
        return meta

    def _seqs_meta(self, pool: KVPool, seqs: list[SeqInput]) -> BatchMeta:
        spans = [(s.start_pos, len(s.token_ids), s.pages) for s in seqs]
        windows = [s.window_pages for s in seqs]
        meta = self._meta(pool, spans, [s.slot for s in seqs], windows)
        meta.copies = root_copies(seqs, pool.page_size, self.device)
        if meta.copies is not None and (pool.window is not None or pool.states is not None):
            raise ValueError(
                "an input with a root needs a pool without a sliding-window entry or recurrent "
                "states (only its KV is shared)"
            )
        return meta

    def _check_groups(self, groups: list[tuple[int, int]] | None) -> list[tuple[int, int]]:
        n = self.config.num_layers
        groups = groups if groups is not None else [(0, n)]
        expect = 0
        for a, b in groups:
            if a != expect or not a < b <= n:
                raise ValueError(f"groups must tile [0, {n}) in order, got {groups}")
            expect = b
        if expect != n:
            raise ValueError(f"groups must tile [0, {n}) in order, got {groups}")
        return groups

    def close(self) -> None:
        """Release what the runner owns beyond memory (a tensor-parallel runner's workers)."""

    def _ids(self, token_ids: list[int]) -> torch.Tensor:
        return torch.tensor(token_ids, dtype=torch.long, device=self.device)

    # ---- forward passes ----------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(
        self,
        pool: KVPool,
        token_ids: list[int],
        pages: list[int],
        groups: list[tuple[int, int]] | None = None,
        on_group: Callable[[int, int], None] | None = None,
        start_pos: int = 0,
        slot: int | None = None,
    ) -> torch.Tensor:
        """One sequence's :meth:`prefill_batch`: its last position's logits [vocab] float32.
        ``slot``: its state slot (a model with recurrent layers; a later chunk, at
        ``start_pos > 0``, continues the state the earlier ones left there)."""
        seq = SeqInput(token_ids, start_pos, pages, slot)
        return self.prefill_batch(pool, [seq], groups, on_group)[0]

    @torch.inference_mode()
    def prefill_batch(
        self,
        pool: KVPool,
        seqs: list[SeqInput],
        groups: list[tuple[int, int]] | None = None,
        on_group: Callable[[int, int], None] | None = None,
        features: bool = False,
    ):
        """Run every sequence's new tokens in ONE forward, layer group by layer group (a
        prompt's later chunk reads its earlier chunks' KV from the pool through its pages).

        After each group (a, b) the KV of layers [a, b) of every sequence is in the pool and
        ``on_group(a, b)`` is called. Returns each sequence's last position's logits
        [B, vocab] float32; with ``features`` also each sequence's final-norm hidden states
        (as :meth:`forward`).
        """
        self._check_pool(pool)
        if not seqs or any(not s.token_ids for s in seqs):
            raise ValueError("prefill needs at least one token per sequence")
        groups = self._check_groups(groups)
        meta = self._seqs_meta(pool, seqs)
        h = self.model.embed(self._ids([t for s in seqs for t in s.token_ids]))  # [T, hidden]
        ends = meta.last_rows  # [B]
        window = _window_buffer(pool)
        for a, b in groups:  # without features only the last positions leave the last layer
            last = ends if not features and b == groups[-1][1] else None
            h = self.model.run_layers(h, meta, pool.tensor, a, b, last, window)
            if on_group is not None:
                on_group(a, b)
        if features:
            normed = self.model.norm(h)
            return self.model.normed_logits(normed[ends]), list(normed.split(meta.lengths))
        return self.model.logits(h)  # [B, vocab]

    @torch.inference_mode()
    def forward(
        self, pool: KVPool, seqs: list[SeqInput], last_only: bool = False, features: bool = False
    ):
        """Batched extend: per sequence logits [len(token_ids), vocab] float32.

        ``last_only``: only each sequence's last position, [1, vocab] (skips the LM head on the
        others; a draft model catching up several tokens needs only the last one).
        ``features``: -> (the logits, per sequence the final-norm hidden states of every
        position [len(token_ids), hidden]: what an EAGLE head reads), from the same forward.
        """
        self._check_pool(pool)
        meta = self._seqs_meta(pool, seqs)
        ids = self._ids([t for s in seqs for t in s.token_ids])
        h = self.model.embed(ids)  # [T, hidden]
        n, window = self.config.num_layers, _window_buffer(pool)
        if last_only and not features:  # only the last positions leave the last layer
            last = meta.last_rows  # [B]
            h = self.model.run_layers(h, meta, pool.tensor, 0, n, last, window)
            return list(self.model.logits(h).split(1))  # B x [1, vocab]
        h = self.model.run_layers(h, meta, pool.tensor, 0, n, None, window)
        normed = self.model.norm(h)  # [T, hidden]
        if last_only:
            logits = list(self.model.normed_logits(normed[meta.last_rows]).split(1))  # B x [1, V]
        else:
            logits = list(self.model.normed_logits(normed).split(meta.lengths))  # [T, vocab]
        return (logits, list(normed.split(meta.lengths))) if features else logits

    @torch.inference_mode()
    def decode(
        self,
        pool: KVPool,
        tokens: list[int],
        positions: list[int],
        page_tables: list[list[int]],
        slots: list[int | None] | None = None,
        window_tables: list[list[int]] | None = None,
    ) -> torch.Tensor:
        """One new token per sequence -> logits [B, vocab] float32. ``slots``: each sequence's
        state slot (a model with recurrent layers: the step advances each state by its token).
        ``window_tables``: each sequence's page table in ``pool.window`` (see
        ``SeqInput.window_pages``)."""
        if not len(tokens) == len(positions) == len(page_tables):
            raise ValueError("tokens, positions and page_tables must have the same length")
        slots = slots if slots is not None else [None] * len(tokens)
        windows = window_tables if window_tables is not None else [None] * len(tokens)
        graphs = self._decode_graphs(pool) if self.use_graphs else None
        if graphs is not None:
            out = graphs.run(tokens, positions, page_tables, window_tables)
            if out is not None:
                return out
        steps = zip(tokens, positions, page_tables, slots, windows, strict=True)
        seqs = [SeqInput([t], p, pt, s, w) for t, p, pt, s, w in steps]
        return torch.cat(self.forward(pool, seqs))

    @torch.inference_mode()
    def _decode_graphs(self, pool: KVPool) -> DecodeGraphs | None:
        """This pool's graphs; None (decode eagerly) where no page is free for their scratch."""
        if id(pool) not in self._graphs:
            self._check_pool(pool)
            pages = -(-self.config.max_position_embeddings // pool.page_size)
            max_pages = min(pool.num_pages, pages)
            try:
                self._graphs[id(pool)] = DecodeGraphs(self, pool, max_pages, self.graph_factory)
            except OutOfPagesError:
                log.warning("CUDA graphs need one free page of the pool; decoding eagerly")
                self._graphs[id(pool)] = None
        return self._graphs[id(pool)]


def _window_buffer(pool: KVPool) -> torch.Tensor | None:
    return None if pool.window is None else pool.window.tensor


def _window_batch(
    meta: BatchMeta,
    window: KVPool,
    seqs: list[tuple[int, int, list[int]]],
    tables: list[list[int] | None] | None,
) -> BatchMeta:
    """``meta`` over the window entry's page tables. A sequence without one uses its ``pages``
    there (the same ids): only while no page of the window entry is held, so those ids are
    nobody else's (a caller that holds every block in both entries: tests, a prefill side)."""
    tables = tables if tables is not None else [None] * len(seqs)
    if len(tables) != len(seqs):
        raise ValueError(f"{len(tables)} window page tables for {len(seqs)} sequences")
    if any(t is None for t in tables) and not window.untouched:
        raise ValueError(
            "a sequence without window pages, but pages of the pool's sliding-window entry are "
            "held: every sequence needs its own there (SeqInput.window_pages, a WindowTable's)"
        )
    spans = [(s, n, p if t is None else t) for (s, n, p), t in zip(seqs, tables, strict=True)]
    return meta.with_pages(spans, window.num_pages)
