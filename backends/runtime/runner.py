"""ModelRunner: run prefill / batched extend / decode of one model over a paged KV pool.

No scheduling here (see :mod:`backends.runtime.engine`); the runner only turns (tokens, positions,
pages) into logits and KV writes.
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
from .paged import BatchMeta, SeqInput

log = logging.getLogger(__name__)


class ModelRunner:
    """One model on one device (a checkpoint is loaded into one by
    :func:`~backends.runtime.loader.load_runner`).

    ``graphs``: whether decode may replay CUDA graphs where the model and device allow them
    (:attr:`use_graphs`). The loader asks for them for a single-rank model, and a self-draft
    for its target's layers; a tensor-parallel rank never does (a replayed step would run rank
    0's shard without the other ranks), nor an EAGLE head (its own forward).
    """

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
        c = self.config
        if c.attn == "gqa":  # per token and layer: K and V of every KV head
            shape = dict(kv_heads=c.num_kv_heads, head_dim=c.head_dim)
        else:  # per token and layer: one latent [c_kv | k_pe]
            rank, rope = c.kv_lora_rank, c.qk_rope_head_dim
            shape = dict(kv_heads=1, head_dim=rank + rope, kv_lora_rank=rank, rope_dim=rope)
        return EntryLayout(
            role=role,
            attn=c.attn,
            dtype=self.kv_dtype,
            scale_log2=self.kv_scale_log2,
            page_size=page_size,
            num_layers=c.num_layers,
            num_pages=num_pages,
            **shape,
        )

    def make_pool(self, num_pages: int, page_size: int, role: str = "target") -> KVPool:
        return KVPool(self.entry_layout(num_pages, page_size, role), self.device)

    def _check_pool(self, pool: KVPool) -> None:
        want = self.entry_layout(pool.num_pages, pool.page_size, pool.layout.role).signature()
        if pool.layout.signature() != want:
            raise ValueError(f"pool layout {pool.layout.signature()} does not fit this model")

    def _meta(self, pool: KVPool, seqs: list[tuple[int, int, list[int]]]) -> BatchMeta:
        limit = self.config.max_position_embeddings
        for start, n, _ in seqs:
            if start < 0 or start + n > limit:
                raise ValueError(
                    f"positions [{start}, {start + n}) outside [0, {limit}) "
                    f"(max_position_embeddings)"
                )
        return BatchMeta.build(
            seqs, pool.page_size, pool.num_pages, self.device, self.config.sliding_window
        )

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
    ) -> torch.Tensor:
        """One sequence's :meth:`prefill_batch`: its last position's logits [vocab] float32."""
        seq = SeqInput(token_ids, start_pos, pages)
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
        meta = self._meta(pool, [(s.start_pos, len(s.token_ids), s.pages) for s in seqs])
        h = self.model.embed(self._ids([t for s in seqs for t in s.token_ids]))  # [T, hidden]
        ends = meta.last_rows  # [B]
        for a, b in groups:  # without features only the last positions leave the last layer
            last = ends if not features and b == groups[-1][1] else None
            h = self.model.run_layers(h, meta, pool.tensor, a, b, last)
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
        meta = self._meta(pool, [(s.start_pos, len(s.token_ids), s.pages) for s in seqs])
        ids = self._ids([t for s in seqs for t in s.token_ids])
        h = self.model.embed(ids)  # [T, hidden]
        if last_only and not features:  # only the last positions leave the last layer
            last = meta.last_rows  # [B]
            h = self.model.run_layers(h, meta, pool.tensor, 0, self.config.num_layers, last)
            return list(self.model.logits(h).split(1))  # B x [1, vocab]
        h = self.model.run_layers(h, meta, pool.tensor, 0, self.config.num_layers)
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
    ) -> torch.Tensor:
        """One new token per sequence -> logits [B, vocab] float32."""
        if not len(tokens) == len(positions) == len(page_tables):
            raise ValueError("tokens, positions and page_tables must have the same length")
        graphs = self._decode_graphs(pool) if self.use_graphs else None
        if graphs is not None:
            out = graphs.run(tokens, positions, page_tables)
            if out is not None:
                return out
        seqs = [
            SeqInput([t], p, pt) for t, p, pt in zip(tokens, positions, page_tables, strict=True)
        ]
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
