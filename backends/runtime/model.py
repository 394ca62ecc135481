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
from .kernels import KernelSettings, Linear
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

    def __call__(self, h: torch.Tensor, meta: BatchMeta, kv: torch.Tensor) -> torch.Tensor:
        # h: [T, hidden]
        h, x = self.post_norm.add(h, self.attn(self.input_norm(h), meta, kv))
        return h + self.mlp(x)


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
        self, h: torch.Tensor, meta: BatchMeta, pool: torch.Tensor, start: int, end: int
    ) -> torch.Tensor:
        """Layers [start, end); pool: the whole entry buffer, indexed by layer first."""
        for i in range(start, end):
            h = self.layers[i](h, meta, pool[i])
        return h

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
