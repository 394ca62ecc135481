"""gpt-oss: Llama's pre-norm block with

* attention sinks: a learned logit per query head (``self_attn.sinks`` [H]) in every softmax's
  denominator, on sliding-window and full layers alternating (``cfg.layer_types``), q/k/v/o with
  biases, YaRN rope (the config's);
* a top-k MoE on every layer: router logits with a bias, the top k of them softmaxed; experts
  with biases, their gate and up projections interleaved in one tensor (``gate_up_proj``
  [E, D, 2I]: gate = columns 0, 2, 4, ..., up = 1, 3, 5, ...) and the clamped SwiGLU
  ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha g)`` with ``g = min(gate, l)``;
* RMSNorm whose weight multiplies in float32 before the one rounding (transformers keeps these
  norms in float32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention import GQAAttention
from ..config import ModelConfig
from ..kernels import KernelSettings
from ..layers import DecoderLayer, Float32RMSNorm, RoutedMoE
from ..rope import RotaryEmbedding
from ..weights import WeightReader


class GptOssRouter:
    def __init__(self, cfg: ModelConfig, w: WeightReader, prefix: str):
        self.weight = w.get(f"{prefix}.weight")  # [E, D]
        self.bias = w.get(f"{prefix}.bias")  # [E]
        self.k = cfg.num_experts_per_tok

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, D] -> (weights [T, k] in x's dtype: a softmax over the top k logits, ids)."""
        top, idx = torch.topk(F.linear(x, self.weight, self.bias), self.k, dim=-1)
        return top.softmax(dim=1, dtype=top.dtype), idx


class GptOssExperts:
    def __init__(self, cfg: ModelConfig, w: WeightReader, prefix: str):
        self.gate_up = w.get(f"{prefix}.gate_up_proj")  # [E, D, 2I], gate / up interleaved
        self.gate_up_b = w.get(f"{prefix}.gate_up_proj_bias")  # [E, 2I]
        self.down = w.get(f"{prefix}.down_proj")  # [E, I, D]
        self.down_b = w.opt(f"{prefix}.down_proj_bias")  # [E, D] (tensor parallel: rank 0's)
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit

    def __call__(self, e: int, xe: torch.Tensor) -> torch.Tensor:
        """Expert e on its tokens: xe [n, D] -> [n, D]."""
        gate_up = xe @ self.gate_up[e] + self.gate_up_b[e]  # [n, 2I]
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        h = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))  # [n, I]
        out = h @ self.down[e]
        return out if self.down_b is None else out + self.down_b[e]


def build_layer(
    cfg: ModelConfig, w: WeightReader, i: int, rope: RotaryEmbedding, kernels: KernelSettings
) -> DecoderLayer:
    p, eps = f"model.layers.{i}", cfg.rms_norm_eps
    sinks = w.get(f"{p}.self_attn.sinks")  # [H]
    window = cfg.layer_window(i)
    attn = GQAAttention(cfg, w, f"{p}.self_attn", rope, kernels, window=window, sinks=sinks)
    router = GptOssRouter(cfg, w, f"{p}.mlp.router")
    mlp = RoutedMoE(router, GptOssExperts(cfg, w, f"{p}.mlp.experts"), cfg.n_routed_experts)
    norms = (f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight")
    return DecoderLayer(attn, mlp, *(Float32RMSNorm(w.get(n), eps, kernels) for n in norms))


def build_norm(cfg: ModelConfig, w: WeightReader, kernels: KernelSettings) -> Float32RMSNorm:
    return Float32RMSNorm(w.get("model.norm.weight"), cfg.rms_norm_eps, kernels)
