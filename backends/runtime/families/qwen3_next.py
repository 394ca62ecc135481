"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (text): a hybrid of gated DeltaNet layers (three in four)
and gated full-attention layers, each a pre-norm residual block (``DecoderLayer``) with an MLP:
a mixture of experts with a sigmoid-gated shared expert (Qwen3-Next, Qwen3.5-MoE) or a dense
SiLU MLP (Qwen3.5).

Their norms are ``(1 + w)`` RMSNorms multiplied in float32 (``Float32RMSNorm``), the attention
layers' q/k norms too. The attention layers: ``q_proj`` gives per head its query and an output
gate (``[q | gate]`` per head); q and k normed per head, rotated on the first
``partial_rotary_factor`` of their channels; paged GQA; ``o(attn * sigmoid(gate))``. The
DeltaNet mixer and its state: :mod:`backends.runtime.recurrent.gated_deltanet`.
"""

from __future__ import annotations

import torch

from ..attention import attend
from ..config import ModelConfig
from ..kernels import KernelSettings, Linear
from ..layers import MLP, DecoderLayer, Experts, Float32RMSNorm, RoutedMoE
from ..paged import BatchMeta, write_kv
from ..recurrent.batch import project
from ..recurrent.gated_deltanet import GatedDeltaNet
from ..rope import RotaryEmbedding
from ..weights import WeightReader
from .qwen3 import Qwen3Router

__all__ = ["build_layer", "build_norm"]

LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")


def offset_norm(w: WeightReader, name: str, eps: float, kernels: KernelSettings) -> Float32RMSNorm:
    """Qwen3-Next's RMSNorm: ``normalised(x) * (1 + w)`` in float32, rounded once."""
    return Float32RMSNorm(w.get(name), eps, kernels, offset=1.0)


class GatedAttention:
    """Qwen3-Next's full attention (see the module docstring). kv: this layer's pool slab
    [2, pages, page_size, Hkv, D]."""

    def __init__(self, cfg: ModelConfig, w: WeightReader, prefix: str, rope, kernels):
        """rope: the RotaryEmbedding of cfg.rope (its first ``rope.dim`` channels of a head)."""
        self.H, self.Hkv, self.D = H, _, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_gate = w.get(f"{prefix}.q_proj.weight")  # [H * 2D, hidden]: per head [q | gate]
        hidden = q_gate.shape[-1]
        q, gate = q_gate.view(H, 2 * D, hidden).split(D, dim=1)  # [H, D, hidden] each
        k, v = (w.get(f"{prefix}.{n}_proj.weight") for n in ("k", "v"))
        biases = [w.opt(f"{prefix}.{n}_proj.bias") for n in ("q", "k", "v")]
        bias = None
        if all(b is not None for b in biases):
            bq, bg = biases[0].view(H, 2 * D).split(D, dim=1)
            bias = torch.cat([bq.reshape(-1), biases[1], biases[2], bg.reshape(-1)])
        # one matmul: [q (H D) | k (Hkv D) | v (Hkv D) | gate (H D)]
        rows = [q.reshape(H * D, hidden), k, v, gate.reshape(H * D, hidden)]
        self.proj = Linear(torch.cat(rows), bias, kernels)
        self.o = Linear(w.get(f"{prefix}.o_proj.weight"), w.opt(f"{prefix}.o_proj.bias"), kernels)
        eps = cfg.rms_norm_eps
        self.q_norm = offset_norm(w, f"{prefix}.q_norm.weight", eps, kernels)
        self.k_norm = offset_norm(w, f"{prefix}.k_norm.weight", eps, kernels)
        self.rope, self.rot = rope, cfg.rope.dim  # rotary on channels [0, rot) of each head
        self.scale, self.kernels = cfg.softmax_scale, kernels

    def __call__(
        self, x: torch.Tensor, meta: BatchMeta, kv: torch.Tensor, residual=None, rows=None
    ):
        """x: [T, hidden] -> [T, hidden] (+ ``residual``), or with ``rows`` [R] those rows only
        (every token's K and V are written)."""
        T, H, Hkv, D = x.shape[0], self.H, self.Hkv, self.D
        q, k, v, gate = self.proj(x).split([H * D, Hkv * D, Hkv * D, H * D], dim=-1)
        q = self.q_norm(q.reshape(T * H, D)).view(T, H, D)
        k = self.k_norm(k.reshape(T * Hkv, D)).view(T, Hkv, D)
        qk = torch.cat([q, k], dim=1)  # [T, H + Hkv, D]: both rotated at once
        rotated = self.rope.apply(qk[..., : self.rot], meta.positions)
        q, k = torch.cat([rotated, qk[..., self.rot :]], dim=-1).split([H, Hkv], dim=1)
        v = v.reshape(T, Hkv, D)
        k_cache, v_cache = kv[0].view(-1, Hkv, D), kv[1].view(-1, Hkv, D)  # [S, Hkv, D]
        write_kv(k_cache, meta, k)
        write_kv(v_cache, meta, v)
        out = attend(q, k, k_cache, meta, self.scale, self.kernels, v_new=v, v_cache=v_cache)
        out = out.reshape(T, H * D) * torch.sigmoid(gate)  # the output gate
        return project(self.o, out, residual, rows)


class SharedExpertMoE:
    """The routed experts (Qwen3-MoE's: softmax top-k, renormalised) plus a shared expert
    weighted by ``sigmoid(shared_expert_gate(x))``."""

    def __init__(self, cfg: ModelConfig, w: WeightReader, prefix: str, kernels: KernelSettings):
        E = cfg.n_routed_experts
        router = Qwen3Router(cfg, w.get(f"{prefix}.gate.weight"))
        self.routed = RoutedMoE(router, Experts(w, f"{prefix}.experts", E), E)
        self.shared = MLP(w, f"{prefix}.shared_expert", kernels)
        self.shared_gate = Linear(w.get(f"{prefix}.shared_expert_gate.weight"), None, kernels)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, D] -> [T, D] (+ residual)
        out = self.routed(x) + torch.sigmoid(self.shared_gate(x)) * self.shared(x)
        return out if residual is None else residual + out


def build_layer(
    cfg: ModelConfig, w: WeightReader, i: int, rope: RotaryEmbedding, kernels: KernelSettings
) -> DecoderLayer:
    p, eps = f"model.layers.{i}", cfg.rms_norm_eps
    mixer = (
        GatedDeltaNet(
            cfg.deltanet, w, f"{p}.linear_attn", kernels, eps, cfg.recurrent_layers.index(i)
        )
        if cfg.layer_types[i] == "linear_attention"
        else GatedAttention(cfg, w, f"{p}.self_attn", rope, kernels)
    )
    moe = cfg.is_moe_layer(i)
    mlp = SharedExpertMoE(cfg, w, f"{p}.mlp", kernels) if moe else MLP(w, f"{p}.mlp", kernels)
    norms = [offset_norm(w, f"{p}.{n}.weight", eps, kernels) for n in LAYER_NORMS]
    return DecoderLayer(mixer, mlp, *norms)


def build_norm(cfg: ModelConfig, w: WeightReader, kernels: KernelSettings) -> Float32RMSNorm:
    return offset_norm(w, "model.norm.weight", cfg.rms_norm_eps, kernels)
