"""The decoder-only causal LM: embedding, decoder layers, final norm, LM head.

Works on flattened token batches (``[T, hidden]``) with a
:class:`~backends.runtime.paged.BatchMeta`; layers can be run in ranges so a caller can act
between layer groups (KV streaming).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import GQAAttention, MLAAttention
from .config import ModelConfig
from .cpu_kernels import cpu_ops
from .kernels import SMALL_ROWS, KernelSettings, Linear
from .layers import MLP, MoE, RMSNorm
from .paged import BatchMeta
from .rope import RotaryEmbedding
from .weights import WeightReader


class DecoderLayer:
    def __init__(
        self,
        cfg: ModelConfig,
        w: WeightReader,
        i: int,
        rope: RotaryEmbedding,
        kernels: KernelSettings,
    ):
        p = f"model.layers.{i}"
        attn_cls = GQAAttention if cfg.attn == "gqa" else MLAAttention
        self.attn = attn_cls(cfg, w, f"{p}.self_attn", rope, kernels)
        if cfg.is_moe_layer(i):
            self.mlp = MoE(cfg, w, f"{p}.mlp", kernels)
        else:
            self.mlp = MLP(w, f"{p}.mlp", kernels)
        eps = cfg.rms_norm_eps
        self.input_norm = RMSNorm(w.get(f"{p}.input_layernorm.weight"), eps, kernels)
        self.post_norm = RMSNorm(w.get(f"{p}.post_attention_layernorm.weight"), eps, kernels)

    def __call__(self, h: torch.Tensor, meta: BatchMeta, kv: torch.Tensor, rows=None):
        """h: [T, hidden] -> [T, hidden]; with ``rows`` ([R] indices) only those rows' outputs,
        [R, hidden]: the o projection and the MLP run on them alone (every row's KV is
        written)."""
        x = self.input_norm(h)
        if self.attn.o.fuses_add(x):  # the residual adds in the o and down GEMMs' epilogues
            h = self.attn(x, meta, kv, residual=h, rows=rows)
            x = self.post_norm(h)
        else:
            out = self.attn(x, meta, kv, rows=rows)
            h, x = self.post_norm.add(h if rows is None else h[rows], out)
        return self.mlp(x, residual=h)


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
        self.rope = RotaryEmbedding(cfg.rope, cfg.max_position_embeddings, device, dtype)
        self.layers = [
            DecoderLayer(cfg, w, i, self.rope, self.kernels) for i in range(cfg.num_layers)
        ]
        self.norm = RMSNorm(w.get("model.norm.weight"), cfg.rms_norm_eps, self.kernels)
        self._head: tuple[torch.Tensor, Linear] | None = None  # (lm_head it packs, Linear)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        # token_ids: [T] -> [T, hidden]
        if token_ids.numel() and (
            int(token_ids.min()) < 0 or int(token_ids.max()) >= self.cfg.vocab_size
        ):
            raise ValueError(f"token id outside the vocabulary [0, {self.cfg.vocab_size})")
        return F.embedding(token_ids, self.embed_tokens)

    def run_layers(
        self,
        h: torch.Tensor,
        meta: BatchMeta,
        pool: torch.Tensor,
        start: int,
        end: int,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Layers [start, end); pool: the whole entry buffer, indexed by layer first.

        ``rows`` [R]: the only rows of the output wanted (a prefill's last positions) -> [R,
        hidden]. Layer ``end - 1`` then runs its o projection and MLP on them alone (about
        2.5 % of SmolLM2's 512-token prefill). They are padded to more than ``SMALL_ROWS`` rows,
        so each GEMM runs the kernel the whole batch would have run: the same bits."""
        keep = None
        if rows is not None and len(h) > SMALL_ROWS + 1:
            fill = torch.arange(max(0, SMALL_ROWS + 1 - len(rows)), device=rows.device)
            keep = torch.cat([rows, fill])  # any rows will do for the padding
        for i in range(start, end):
            h = self.layers[i](h, meta, pool[i], keep if i == end - 1 else None)
        if rows is None:
            return h
        return h[: len(rows)] if keep is not None else h[rows]

    def head(self) -> Linear:
        """The LM head as a :class:`Linear`, rebuilt if ``lm_head`` was replaced (a draft)."""
        if self._head is None or self._head[0] is not self.lm_head:
            self._head = (self.lm_head, Linear(self.lm_head, None, self.kernels))
        return self._head[1]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        # h: [T, hidden] -> [T, V] float32
        return self.normed_logits(self.norm(h))

    def normed_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The LM head on final-norm hidden states (the features an EAGLE head reads)."""
        return self.head()(normed).float()
