"""Granite 4.0-H (``GraniteMoeHybridForCausalLM``): Mamba2 layers (the same mixer as Nemotron-H's)
and GQA attention layers (rotary only with ``position_embedding_type: rope``; softmax scale
``attention_multiplier``), each a pre-norm residual block of its mixer and then of a top-k
mixture of SwiGLU experts plus a shared SwiGLU MLP. Both blocks' outputs are scaled by
``residual_multiplier`` before their residual add; Llama's RMSNorm. The router softmaxes the
``k`` best router logits (float32), rounded to the model dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention import GQAAttention
from ..config import ModelConfig
from ..kernels import KernelSettings
from ..layers import MLP, Experts, RoutedMoE
from ..paged import BatchMeta
from ..recurrent.mamba2 import Mamba2Mixer
from ..rope import RotaryEmbedding
from ..weights import WeightReader
from .llama import build_norm, layer_norms
from .nemotron_h import PlainAttention

__all__ = ["build_layer", "build_norm"]


class TopKSoftmaxRouter:
    def __init__(self, weight: torch.Tensor, k: int):
        self.weight, self.k = weight, k  # [E, D]

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, D] -> (weights [T, k] in x's dtype, expert ids [T, k])."""
        top, idx = F.linear(x, self.weight).float().topk(self.k, dim=-1)
        return top.softmax(-1).to(x.dtype), idx


def routed_moe(cfg: ModelConfig, w: WeightReader, prefix: str) -> RoutedMoE:
    """The routed experts as Granite's checkpoints store them (``router.layer``, the experts'
    ``input_linear`` [E, 2I, D] packing [gate | up] and ``output_linear`` [E, D, I]), or as
    transformers 5 names them (``router``, ``experts.gate_up_proj`` / ``down_proj``)."""
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    if w.has(f"{prefix}.input_linear.weight"):
        packed = {
            f"{prefix}.experts.gate_up_proj": w.get(f"{prefix}.input_linear.weight"),
            f"{prefix}.experts.down_proj": w.get(f"{prefix}.output_linear.weight"),
        }
        experts = Experts(WeightReader(packed, w.source), f"{prefix}.experts", E)
        router = w.get(f"{prefix}.router.layer.weight")
    else:
        experts, router = Experts(w, f"{prefix}.experts", E), w.get(f"{prefix}.router.weight")
    return RoutedMoE(TopKSoftmaxRouter(router, k), experts, E)


def shared_mlp(w: WeightReader, prefix: str, kernels: KernelSettings) -> MLP:
    """The shared MLP: ``input_linear`` packs [gate | up], ``output_linear`` is down."""
    gate, up = w.get(f"{prefix}.input_linear.weight").chunk(2, dim=0)
    names = {"gate_proj": gate, "up_proj": up, "down_proj": w.get(f"{prefix}.output_linear.weight")}
    parts = WeightReader({f"{prefix}.{n}.weight": t for n, t in names.items()}, w.source)
    return MLP(parts, prefix, kernels)


class ScaledBlockLayer:
    """``h += m * mixer(input_norm(h))``, then ``h += m * (moe(x) + shared(x))`` with
    ``x = post_norm(h)`` and ``m`` the residual multiplier."""

    def __init__(self, mixer, moe, shared, input_norm, post_norm, multiplier: float):
        self.mixer, self.moe, self.shared = mixer, moe, shared
        self.input_norm, self.post_norm, self.m = input_norm, post_norm, multiplier

    def __call__(self, h: torch.Tensor, meta: BatchMeta, kv: torch.Tensor | None, rows=None):
        """h: [T, hidden] -> [T, hidden], or with ``rows`` [R] those rows only."""
        out = self.mixer(self.input_norm(h), meta, kv, rows=rows)  # [T or R, hidden]
        h = (h if rows is None else h[rows]) + out * self.m
        x = self.post_norm(h)
        ffn = self.shared(x) if self.moe is None else self.moe(x) + self.shared(x)
        return h + ffn * self.m


def build_layer(
    cfg: ModelConfig, w: WeightReader, i: int, rope: RotaryEmbedding, kernels: KernelSettings
) -> ScaledBlockLayer:
    p = f"model.layers.{i}"
    if cfg.layer_types[i] == "mamba":
        mixer = Mamba2Mixer(cfg.mamba, w, f"{p}.mamba", kernels, cfg.recurrent_layers.index(i))
    elif cfg.position_embedding == "rope":
        mixer = GQAAttention(cfg, w, f"{p}.self_attn", rope, kernels)
    else:
        mixer = PlainAttention(cfg, w, f"{p}.self_attn", kernels)
    moe = routed_moe(cfg, w, f"{p}.block_sparse_moe") if cfg.n_routed_experts else None
    shared = shared_mlp(w, f"{p}.shared_mlp", kernels)
    norms = layer_norms(cfg, w, p, kernels)
    return ScaledBlockLayer(mixer, moe, shared, *norms, cfg.residual_multiplier)
