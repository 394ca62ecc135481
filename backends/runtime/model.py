"""The decoder-only causal LM: embedding, decoder layers, final norm, LM head.

Works on flattened token batches (``[T, hidden]``) with a
:class:`~backends.runtime.paged.BatchMeta`; layers can be run in ranges so a caller can act
between layer groups (KV streaming). Each family builds its layers and final norm
(:mod:`backends.runtime.families`); what the model adds around them comes from the config: an
embedding multiplier (Gemma 3: sqrt(hidden)), final logit soft-capping, and one rotary
embedding per distinct rope of its layers (Gemma 3's sliding layers have their own).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import MAIN, WINDOW, ModelConfig, RopeConfig
from .cpu_kernels import cpu_ops
from .families import family_of
from .kernels import SMALL_ROWS, KernelSettings, Linear
from .paged import BatchMeta
from .recurrent.batch import RecurrentStateLost
from .rope import RotaryEmbedding
from .weights import WeightReader


def kv_slabs(cfg: ModelConfig) -> tuple[tuple[str, int] | None, ...]:
    """Each layer of ``cfg``'s model: its (entry, slab), or None (see ``CausalLM.kv_slab``)."""
    where = {layer: (MAIN, j) for j, layer in enumerate(cfg.full_kv_layers)}
    where.update({layer: (WINDOW, j) for j, layer in enumerate(cfg.window_kv_layers)})
    return tuple(where.get(i) for i in range(cfg.num_layers))


class CausalLM:
    def __init__(self, cfg: ModelConfig, w: WeightReader, device, dtype: torch.dtype):
        self.cfg = cfg
        self.kernels = KernelSettings.from_env()
        if torch.device(device).type == "cpu" and "auto" in (
            self.kernels.attention,
            self.kernels.fused,
        ):
            cpu_ops()  # build or load the C++ kernels now, not at the first step
        self.embed_tokens = w.get("model.embed_tokens.weight")  # [V, hidden]
        if cfg.tie_word_embeddings or not w.has("lm_head.weight"):
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = w.get("lm_head.weight")  # [V, hidden]
        # the multiplier in the model dtype, as transformers rounds it (Gemma 3)
        mult = cfg.embedding_multiplier
        self.embed_scale = None if mult == 1.0 else torch.tensor(mult, dtype=dtype, device=device)
        self.ropes: dict[RopeConfig, RotaryEmbedding] = {}
        self.rope = self._rope(cfg.rope, device, dtype)
        family = family_of(cfg)
        ropes = [self._rope(cfg.layer_rope(i), device, dtype) for i in range(cfg.num_layers)]
        self.layers = [
            family.build_layer(cfg, w, i, rope, self.kernels) for i, rope in enumerate(ropes)
        ]
        self.norm = family.build_norm(cfg, w, self.kernels)
        self._head: tuple[torch.Tensor, Linear] | None = None  # (lm_head it packs, Linear)
        self._slabs = (cfg, kv_slabs(cfg))  # (the config they are of, kv_slab)

    @property
    def kv_slab(self) -> tuple[tuple[str, int] | None, ...]:
        """Each layer's (entry, slab) in the pool: ``MAIN`` (the model's entry, slab = its index
        among ``cfg.full_kv_layers``) or ``WINDOW`` (``pool.window``, its index among
        ``cfg.window_kv_layers``); None for a hybrid's recurrent and MLP-only layers, which keep
        no KV (their state: BatchMeta.recurrent). From ``cfg``, so a self-draft's truncated
        config has its own."""
        if self._slabs[0] is not self.cfg:
            self._slabs = (self.cfg, kv_slabs(self.cfg))
        return self._slabs[1]

    def _rope(self, rope: RopeConfig, device, dtype) -> RotaryEmbedding:
        """One table per distinct rotary configuration, shared by the layers that use it."""
        if rope not in self.ropes:
            pos = self.cfg.max_position_embeddings
            self.ropes[rope] = RotaryEmbedding(rope, pos, device, dtype)
        return self.ropes[rope]

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        # token_ids: [T] -> [T, hidden]
        if token_ids.numel() and (
            int(token_ids.min()) < 0 or int(token_ids.max()) >= self.cfg.vocab_size
        ):
            raise ValueError(f"token id outside the vocabulary [0, {self.cfg.vocab_size})")
        return self.embed_rows(token_ids)

    def embed_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """:meth:`embed` without the host-side check of the ids (CUDA graphs' capture)."""
        h = F.embedding(token_ids, self.embed_tokens)  # [T, hidden]
        return h if self.embed_scale is None else h * self.embed_scale

    def run_layers(
        self,
        h: torch.Tensor,
        meta: BatchMeta,
        pool: torch.Tensor,
        start: int,
        end: int,
        rows: torch.Tensor | None = None,
        window_pool: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Layers [start, end); pool: the whole entry buffer, indexed by KV layer first
        (``kv_slab``); a model with a sliding-window entry also ``window_pool``, its buffer,
        whose layers attend through ``meta.window_batch``.

        ``rows`` [R]: the only rows of the output wanted (a prefill's last positions) -> [R,
        hidden]. Layer ``end - 1`` then runs its o projection and MLP on them alone (about
        2.5 % of SmolLM2's 512-token prefill). They are padded to more than ``SMALL_ROWS`` rows,
        so each GEMM runs the kernel the whole batch would have run: the same bits.

        A failure in a batch where some sequence continues a recurrent state raises
        :class:`~backends.runtime.recurrent.batch.RecurrentStateLost`: the states updated so far
        cannot be undone, so the batch cannot be retried."""
        keep = None
        if rows is not None and len(h) > SMALL_ROWS + 1:
            fill = torch.arange(max(0, SMALL_ROWS + 1 - len(rows)), device=rows.device)
            keep = torch.cat([rows, fill])  # any rows will do for the padding
        slabs = self.kv_slab
        try:
            for i in range(start, end):
                where, kv, seen = slabs[i], None, meta
                if where is not None:
                    if where[0] is MAIN:
                        kv = pool[where[1]]
                    else:  # the sliding-window entry, through its own batch
                        kv, seen = self._window_kv(i, where[1], meta, window_pool)
                h = self.layers[i](h, seen, kv, keep if i == end - 1 else None)
        except Exception as e:
            if meta.recurrent is not None and meta.recurrent.carries_state:
                raise RecurrentStateLost(
                    f"a forward failed after updating recurrent states in place: {e}"
                ) from e
            raise
        if rows is None:
            return h
        return h[: len(rows)] if keep is not None else h[rows]

    @staticmethod
    def _window_kv(layer: int, slab: int, meta: BatchMeta, window_pool):
        if window_pool is None or meta.window_batch is None:
            raise ValueError(f"layer {layer} keeps its KV in the {WINDOW} entry: none given")
        return window_pool[slab], meta.window_batch

    def head(self) -> Linear:
        """The LM head as a :class:`Linear`, rebuilt if ``lm_head`` was replaced (a draft)."""
        if self._head is None or self._head[0] is not self.lm_head:
            self._head = (self.lm_head, Linear(self.lm_head, None, self.kernels))
        return self._head[1]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        # h: [T, hidden] -> [T, V] float32
        return self.normed_logits(self.norm(h))

    def normed_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The LM head on final-norm hidden states (the features an EAGLE head reads), soft-capped
        in the model dtype where the config says so (Gemma 3)."""
        logits = self.head()(normed)
        if self.cfg.logits_scaling != 1.0:  # Granite 4.0-H
            logits = logits / self.cfg.logits_scaling
        cap = self.cfg.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
