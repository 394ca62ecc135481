"""Qwen3 and Qwen3-MoE: Llama's pre-norm block with an RMSNorm over each head's q and k before
the rotation (one weight [head_dim] for the q heads, one for the k heads), and in Qwen3-MoE's
sparse layers a top-k mixture of gated-SiLU experts without shared experts.

Qwen3-MoE routing (transformers' ``Qwen3MoeTopKRouter``): router logits in the model dtype,
softmax over all experts in float32, top-k, renormalised over the k when ``norm_topk_prob``,
then rounded to the model dtype: each expert's output is weighted and summed in the model dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention import QKNormAttention
from ..config import ModelConfig
from ..kernels import KernelSettings
from ..layers import MLP, DecoderLayer, Experts, RMSNorm, RoutedMoE
from ..rope import RotaryEmbedding
from ..weights import WeightReader
from .llama import build_norm, layer_norms

__all__ = ["build_layer", "build_norm"]


class Qwen3Router:
    def __init__(self, cfg: ModelConfig, weight: torch.Tensor):
        self.weight = weight  # [E, D]
        self.k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, D] -> (weights [T, k] in x's dtype, expert ids [T, k])."""
        probs = F.linear(x, self.weight).softmax(-1, dtype=torch.float32)  # [T, E]
        weights, idx = torch.topk(probs, self.k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(x.dtype), idx


def build_layer(
    cfg: ModelConfig, w: WeightReader, i: int, rope: RotaryEmbedding, kernels: KernelSettings
) -> DecoderLayer:
    p, eps = f"model.layers.{i}", cfg.rms_norm_eps
    q_norm = RMSNorm(w.get(f"{p}.self_attn.q_norm.weight"), eps, kernels)
    k_norm = RMSNorm(w.get(f"{p}.self_attn.k_norm.weight"), eps, kernels)
    window = cfg.layer_window(i)
    attn = QKNormAttention(cfg, w, f"{p}.self_attn", rope, kernels, q_norm, k_norm, window)
    if cfg.is_moe_layer(i):
        E = cfg.n_routed_experts
        router = Qwen3Router(cfg, w.get(f"{p}.mlp.gate.weight"))
        mlp = RoutedMoE(router, Experts(w, f"{p}.mlp.experts", E), E)
    else:
        mlp = MLP(w, f"{p}.mlp", kernels, cfg.hidden_act)
    return DecoderLayer(attn, mlp, *layer_norms(cfg, w, p, kernels))
