"""Gemma 3 (text): each layer normalises around both of its blocks ("sandwich" norms)::

    h = h + post_attention_norm(attn(input_norm(h)))
    h = h + post_feedforward_norm(mlp(pre_feedforward_norm(h)))

with Gemma's RMSNorm (weight stored as ``w``, applied as ``1 + w`` in float32, rounded once), a
Gemma norm over each head's q and k before the rotation, the softmax scale
``query_pre_attn_scalar ** -0.5``, a GeGLU MLP (``gelu_pytorch_tanh``), and sliding-window and
global layers interleaved (``cfg.layer_types``), each kind with its own rotary embedding
(``cfg.layer_rope``). The embedding scale (sqrt(hidden), in the model dtype) and the final logit
soft-capping are the model's (:class:`~backends.runtime.model.CausalLM`), from the config.
"""

from __future__ import annotations

import torch

from ..attention import QKNormAttention
from ..config import ModelConfig
from ..kernels import KernelSettings
from ..layers import MLP, Float32RMSNorm
from ..rope import RotaryEmbedding
from ..weights import WeightReader


def gemma_norm(w: WeightReader, name: str, eps: float, kernels: KernelSettings) -> Float32RMSNorm:
    return Float32RMSNorm(w.get(name), eps, kernels, offset=1.0)


class Gemma3Layer:
    def __init__(
        self,
        cfg: ModelConfig,
        w: WeightReader,
        i: int,
        rope: RotaryEmbedding,
        kernels: KernelSettings,
    ):
        p, eps = f"model.layers.{i}", cfg.rms_norm_eps
        q_norm = gemma_norm(w, f"{p}.self_attn.q_norm.weight", eps, kernels)
        k_norm = gemma_norm(w, f"{p}.self_attn.k_norm.weight", eps, kernels)
        window = cfg.layer_window(i)
        self.attn = QKNormAttention(cfg, w, f"{p}.self_attn", rope, kernels, q_norm, k_norm, window)
        self.mlp = MLP(w, f"{p}.mlp", kernels, cfg.hidden_act)
        norms = ("input", "post_attention", "pre_feedforward", "post_feedforward")
        self.input_norm, self.post_attn_norm, self.pre_ff_norm, self.post_ff_norm = (
            gemma_norm(w, f"{p}.{n}_layernorm.weight", eps, kernels) for n in norms
        )

    def __call__(self, h: torch.Tensor, meta, kv: torch.Tensor, rows=None) -> torch.Tensor:
        """h: [T, hidden] -> [T, hidden] (with ``rows``: [R, hidden], those rows only; every
        row's KV is written)."""
        out = self.attn(self.input_norm(h), meta, kv, rows=rows)  # [T or R, hidden]
        h, x = self.pre_ff_norm.add(h if rows is None else h[rows], self.post_attn_norm(out))
        return h + self.post_ff_norm(self.mlp(x))


def build_layer(
    cfg: ModelConfig, w: WeightReader, i: int, rope: RotaryEmbedding, kernels: KernelSettings
) -> Gemma3Layer:
    return Gemma3Layer(cfg, w, i, rope, kernels)


def build_norm(cfg: ModelConfig, w: WeightReader, kernels: KernelSettings) -> Float32RMSNorm:
    return gemma_norm(w, "model.norm.weight", cfg.rms_norm_eps, kernels)
