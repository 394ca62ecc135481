"""Nemotron-H: a stack of single-mixer blocks, each ``h + mixer(norm(h))``, the mixer one of
Mamba2 (``"mamba"``), attention (``"full_attention"``: GQA with no rotary embedding, position
comes from the Mamba2 layers) or an MLP (``"mlp"``: ``down(relu(up(x)) ** 2)``, no gate), as
``hybrid_override_pattern`` / ``layers_block_type`` orders them. Its RMSNorms multiply by the
weight in float32 (``Float32RMSNorm``). The Mamba2 mixer and its state:
:mod:`backends.runtime.recurrent.mamba2`. Checkpoints name the embedding ``embeddings`` and
the final norm ``norm_f`` (:mod:`backends.runtime.weights` maps the original ``backbone.``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention import attend
from ..config import ModelConfig
from ..kernels import KernelSettings, Linear
from ..layers import Float32RMSNorm
from ..paged import BatchMeta, write_kv
from ..recurrent.batch import project
from ..recurrent.mamba2 import Mamba2Mixer
from ..rope import RotaryEmbedding
from ..weights import WeightReader

__all__ = ["build_layer", "build_norm"]


def _linear(w: WeightReader, name: str, kernels: KernelSettings) -> Linear:
    return Linear(w.get(f"{name}.weight"), w.opt(f"{name}.bias"), kernels)


class PlainAttention:
    """GQA over the paged pool without a rotary embedding. kv: this layer's pool slab
    [2, pages, page_size, Hkv, D]."""

    def __init__(self, cfg: ModelConfig, w: WeightReader, prefix: str, kernels: KernelSettings):
        self.H, self.Hkv, self.D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, k, v = (w.get(f"{prefix}.{n}_proj.weight") for n in ("q", "k", "v"))
        biases = [w.opt(f"{prefix}.{n}_proj.bias") for n in ("q", "k", "v")]
        bias = torch.cat(biases) if all(b is not None for b in biases) else None
        self.qkv = Linear(torch.cat([q, k, v]), bias, kernels)  # [(H + 2 Hkv) D, hidden]
        self.o = _linear(w, f"{prefix}.o_proj", kernels)
        self.scale, self.kernels = cfg.softmax_scale, kernels

    def __call__(
        self, x: torch.Tensor, meta: BatchMeta, kv: torch.Tensor, residual=None, rows=None
    ):
        """x: [T, hidden] -> [T, hidden] (+ ``residual``), or with ``rows`` [R] those rows only
        (every token's K and V are written)."""
        T, H, Hkv, D = x.shape[0], self.H, self.Hkv, self.D
        q, k, v = self.qkv(x).view(T, H + 2 * Hkv, D).split([H, Hkv, Hkv], dim=1)
        k_cache, v_cache = kv[0].view(-1, Hkv, D), kv[1].view(-1, Hkv, D)  # [S, Hkv, D]
        write_kv(k_cache, meta, k)
        write_kv(v_cache, meta, v)
        out = attend(q, k, k_cache, meta, self.scale, self.kernels, v_new=v, v_cache=v_cache)
        return project(self.o, out.reshape(T, H * D), residual, rows)


class ReluSquaredMLP:
    """Nemotron-H's MLP block as a mixer: ``down(relu(up(x)) ** 2)``."""

    def __init__(self, w: WeightReader, prefix: str, kernels: KernelSettings):
        self.up = _linear(w, f"{prefix}.up_proj", kernels)
        self.o = _linear(w, f"{prefix}.down_proj", kernels)

    def __call__(self, x: torch.Tensor, meta=None, kv=None, residual=None, rows=None):
        # x: [T, hidden] -> [T, hidden] (+ residual); with rows [R] those rows only
        if rows is not None:
            x = x[rows]
            residual = None if residual is None else residual[rows]
        h = F.relu(self.up(x)).square()
        return self.o(h) if residual is None else self.o.add(h, residual)


class MixerBlock:
    """``h + mixer(norm(h))``: one Nemotron-H layer. ``mixer(x, meta, kv, residual=, rows=)``
    (the residual added in its out projection's GEMM where it can)."""

    def __init__(self, norm: Float32RMSNorm, mixer):
        self.norm, self.mixer = norm, mixer

    def __call__(self, h: torch.Tensor, meta: BatchMeta, kv: torch.Tensor | None, rows=None):
        """h: [T, hidden] -> [T, hidden], or with ``rows`` [R] those rows only."""
        return self.mixer(self.norm(h), meta, kv, residual=h, rows=rows)


def build_layer(
    cfg: ModelConfig, w: WeightReader, i: int, rope: RotaryEmbedding, kernels: KernelSettings
) -> MixerBlock:
    p, kind = f"model.layers.{i}", cfg.layer_types[i]
    if kind == "mamba":
        mixer = Mamba2Mixer(cfg.mamba, w, f"{p}.mixer", kernels, cfg.recurrent_layers.index(i))
    elif kind == "full_attention":
        mixer = PlainAttention(cfg, w, f"{p}.mixer", kernels)
    else:
        mixer = ReluSquaredMLP(w, f"{p}.mixer", kernels)
    return MixerBlock(_norm(w, f"{p}.norm.weight", cfg.rms_norm_eps, kernels), mixer)


def _norm(w: WeightReader, name: str, eps: float, kernels: KernelSettings) -> Float32RMSNorm:
    return Float32RMSNorm(w.get(name), eps, kernels)


def build_norm(cfg: ModelConfig, w: WeightReader, kernels: KernelSettings) -> Float32RMSNorm:
    return _norm(w, "model.norm_f.weight", cfg.rms_norm_eps, kernels)
