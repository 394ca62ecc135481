"""The Llama family and its relatives: Llama, Mistral, Qwen2 (GQA) and DeepSeek V2/V3 (MLA), each
layer a pre-norm residual block of attention and a SiLU MLP or DeepSeek's MoE, RMSNorm
(Llama's: the normalised x rounded to the model dtype before the weight)."""

from __future__ import annotations

from ..attention import GQAAttention, MLAAttention
from ..config import ModelConfig
from ..kernels import KernelSettings
from ..layers import MLP, DecoderLayer, MoE, RMSNorm
from ..rope import RotaryEmbedding
from ..weights import WeightReader


def build_layer(
    cfg: ModelConfig, w: WeightReader, i: int, rope: RotaryEmbedding, kernels: KernelSettings
) -> DecoderLayer:
    p = f"model.layers.{i}"
    if cfg.attn == "gqa":
        window = cfg.layer_window(i)
        attn = GQAAttention(cfg, w, f"{p}.self_attn", rope, kernels, window=window)
    else:
        attn = MLAAttention(cfg, w, f"{p}.self_attn", rope, kernels)
    if cfg.is_moe_layer(i):
        mlp = MoE(cfg, w, f"{p}.mlp", kernels)
    else:
        mlp = MLP(w, f"{p}.mlp", kernels, cfg.hidden_act)
    return DecoderLayer(attn, mlp, *layer_norms(cfg, w, p, kernels))


def layer_norms(
    cfg: ModelConfig, w: WeightReader, prefix: str, kernels: KernelSettings
) -> tuple[RMSNorm, RMSNorm]:
    """A layer's input and post-attention RMSNorms."""
    eps = cfg.rms_norm_eps
    return (
        RMSNorm(w.get(f"{prefix}.input_layernorm.weight"), eps, kernels),
        RMSNorm(w.get(f"{prefix}.post_attention_layernorm.weight"), eps, kernels),
    )


def build_norm(cfg: ModelConfig, w: WeightReader, kernels: KernelSettings) -> RMSNorm:
    return RMSNorm(w.get("model.norm.weight"), cfg.rms_norm_eps, kernels)
