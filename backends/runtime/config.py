"""Model configuration: parse a checkpoint's ``config.json`` once, validate loudly.

Supported families:

* Llama-style GQA decoders (``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``).
* DeepSeek MLA + MoE decoders (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``).

Both the transformers 5.x ``rope_parameters`` dict and the older ``rope_theta`` +
``rope_scaling`` pair are understood.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

GQA_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
SUPPORTED_ARCHITECTURES = GQA_ARCHITECTURES + MLA_ARCHITECTURES
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
SUPPORTED_ACTIVATIONS = ("silu",)


class UnsupportedArchitectureError(ValueError):
    """The checkpoint's architecture (or one of its features) is not implemented here."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (see :mod:`backends.rope` for the math).

    ``style`` says how rotated pairs are laid out: ``"half"`` rotates (x[i], x[i + d/2]) (Llama);
    ``"interleave"`` rotates (x[2i], x[2i+1]) and writes the result de-interleaved as
    DeepSeek-V3 does; ``"complex"`` rotates (x[2i], x[2i+1]) and keeps them interleaved as
    DeepSeek-V2 does.
    """

    dim: int
    theta: float = 10000.0
    type: str = "default"
    style: str = "half"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    attn: str  # "gqa" | "mla"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # GQA: per-head dim; MLA: qk_nope_head_dim + qk_rope_head_dim
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # MLA
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # MoE (DeepSeek); n_routed_experts == 0 means every layer is dense
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    scoring: str = "softmax"  # "softmax" (V2) | "sigmoid" (V3)
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"config field {name} must be a positive integer, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def softmax_scale(self) -> float:
        """Attention score scale, with DeepSeek's YaRN ``mscale_all_dim`` correction."""
        scale = self.head_dim**-0.5
        r = self.rope
        if self.attn == "mla" and r.type != "default" and r.mscale_all_dim:
            m = yarn_mscale(r.factor, r.mscale_all_dim)
            scale = scale * m * m
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.n_routed_experts > 0
            and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0
        )

    def truncated(self, num_layers: int) -> ModelConfig:
        """The same model cut to its first ``num_layers`` decoder layers (a self-draft)."""
        if not 0 < num_layers <= self.num_layers:
            raise ValueError(f"num_layers must be in [1, {self.num_layers}], got {num_layers}")
        return replace(self, num_layers=num_layers)

    @classmethod
    def from_pretrained(cls, path: str) -> ModelConfig:
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"no config.json in model directory {path!r}")
        with open(cfg_path) as f:
            raw = json.load(f)
        gen_path = os.path.join(path, "generation_config.json")
        gen = {}
        if os.path.isfile(gen_path):
            with open(gen_path) as f:
                gen = json.load(f)
        return cls.from_dict(raw, gen)

    @classmethod
    def from_dict(cls, raw: dict, generation: dict | None = None) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedArchitectureError(
                f"unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        act = raw.get("hidden_act", "silu")
        if act not in SUPPORTED_ACTIVATIONS:
            raise UnsupportedArchitectureError(
                f"hidden_act {act!r} not supported; supported: {SUPPORTED_ACTIVATIONS}"
            )
        eos = _eos_ids(raw.get("eos_token_id"), (generation or {}).get("eos_token_id"))
        heads = raw["num_attention_heads"]
        common = dict(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            intermediate_size=raw["intermediate_size"],
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            eos_token_ids=eos,
            bos_token_id=raw.get("bos_token_id"),
        )
        if arch in GQA_ARCHITECTURES:
            return cls(**common, **_gqa_fields(raw, arch))
        common["num_kv_heads"] = heads  # MLA: every head reads the same latent
        return cls(**common, **_mla_fields(raw, arch))


def _gqa_fields(raw: dict, arch: str) -> dict:
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    window = raw.get("sliding_window")
    if arch == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
        window = None
    bias = bool(raw.get("attention_bias", False))
    return dict(
        attn="gqa",
        head_dim=head_dim,
        rope=_rope(raw, head_dim, "half"),
        qkv_bias=bias or arch == "Qwen2ForCausalLM",
        o_bias=bias,
        sliding_window=window,
    )


def _mla_fields(raw: dict, arch: str) -> dict:
    v3 = arch == "DeepseekV3ForCausalLM"
    rope_dim = raw["qk_rope_head_dim"]
    style = ("interleave" if raw.get("rope_interleave", True) else "half") if v3 else "complex"
    bias = bool(raw.get("attention_bias", False))
    return dict(
        attn="mla",
        head_dim=raw["qk_nope_head_dim"] + rope_dim,
        rope=_rope(raw, rope_dim, style),
        o_bias=bias,
        qkv_bias=bias,
        q_lora_rank=raw.get("q_lora_rank"),
        kv_lora_rank=raw["kv_lora_rank"],
        qk_nope_head_dim=raw["qk_nope_head_dim"],
        qk_rope_head_dim=rope_dim,
        v_head_dim=raw["v_head_dim"],
        n_routed_experts=raw.get("n_routed_experts") or 0,
        n_shared_experts=raw.get("n_shared_experts") or 0,
        num_experts_per_tok=raw.get("num_experts_per_tok") or 0,
        moe_intermediate_size=raw.get("moe_intermediate_size") or 0,
        first_k_dense_replace=raw.get("first_k_dense_replace", 0),
        moe_layer_freq=raw.get("moe_layer_freq", 1) or 1,
        scoring="sigmoid" if v3 else "softmax",
        topk_method=raw.get("topk_method") or ("noaux_tc" if v3 else "greedy"),
        n_group=raw.get("n_group") or 1,
        topk_group=raw.get("topk_group") or 1,
        norm_topk_prob=bool(raw.get("norm_topk_prob", v3)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
    )


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    import math

    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _eos_ids(*values) -> tuple[int, ...]:
    out: list[int] = []
    for v in values:
        for i in v if isinstance(v, list) else [v]:
            if isinstance(i, int) and i not in out:
                out.append(i)
    return tuple(out)


def _rope(raw: dict, dim: int, style: str) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or {})
    legacy = raw.get("rope_scaling") or {}
    for k, v in legacy.items():
        params.setdefault(k, v)
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rtype = params.get("rope_type") or params.get("type") or "default"
    if rtype not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedArchitectureError(
            f"rope type {rtype!r} not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedArchitectureError("partial_rotary_factor != 1 is not supported")
    factor = params.get("factor")
    if rtype in ("linear", "llama3") and factor is None:
        raise ValueError(f"rope type {rtype!r} needs a 'factor' in rope_parameters/rope_scaling")
    max_pos = raw.get("max_position_embeddings", 0)
    orig = params.get("original_max_position_embeddings") or max_pos
    if factor is None:  # yarn without a factor: the context extension ratio (as DeepSeek-V3)
        factor = max_pos / orig if rtype == "yarn" and orig else 1.0
    return RopeConfig(
        dim=dim,
        theta=float(theta),
        type=rtype,
        style=style,
        factor=float(factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(orig),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )
