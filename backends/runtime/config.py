"""Model configuration: parse a checkpoint's ``config.json`` once, validate loudly.

Supported families (each built from its blocks by :mod:`backends.runtime.families`):

* Llama-style GQA decoders (``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``).
* DeepSeek MLA + MoE decoders (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``).
* Qwen3 (``Qwen3ForCausalLM``) and Qwen3-MoE (``Qwen3MoeForCausalLM``): GQA with an RMSNorm over
  each head's q and k; the MoE routes top-k of a softmax over its experts.
* Gemma 3 text (``Gemma3ForCausalLM``): sliding-window and global layers interleaved
  (``layer_types``), each kind with its own rotary base; Gemma's ``(1 + w)`` norms before and
  after attention and MLP, q/k norms, embeddings times sqrt(hidden), the softmax scale from
  ``query_pre_attn_scalar``, GeGLU MLP, final logit soft-capping. The multimodal
  ``Gemma3ForConditionalGeneration`` and attention-logit soft-capping are refused.
* gpt-oss (``GptOssForCausalLM``): sliding-window and full layers alternating, a learned sink
  logit per head in every softmax, a top-k MoE with biases and the clamped SwiGLU, YaRN rope.
  MXFP4-quantized expert weights are refused (load a dequantized checkpoint).

Per-layer attention: ``layer_types`` (one ``"full_attention"`` / ``"sliding_attention"`` per
layer, as transformers names them) with :meth:`ModelConfig.layer_window` and
:meth:`ModelConfig.layer_rope`; a model without ``layer_types`` has ``sliding_window`` (or
none) on every layer (Mistral).

Both the transformers 5.x ``rope_parameters`` dict and the older ``rope_theta`` +
``rope_scaling`` pair are understood.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

GQA_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Gemma3ForCausalLM",
    "GptOssForCausalLM",
)
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
# recurrent hybrids: GQA attention layers among gated DeltaNet or Mamba2 layers (_HYBRID_FIELDS)
HYBRID_ARCHITECTURES = (
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "NemotronHForCausalLM",
    "GraniteMoeHybridForCausalLM",
)
SUPPORTED_ARCHITECTURES = GQA_ARCHITECTURES + MLA_ARCHITECTURES + HYBRID_ARCHITECTURES
# architectures of a supported family that are refused, and why
REFUSED_ARCHITECTURES = {
    "Gemma3ForConditionalGeneration": (
        "Gemma 3 multimodal checkpoints (vision tower + text decoder) are not supported; the "
        "text-only Gemma3ForCausalLM is (e.g. gemma-3-1b, or the text decoder saved on its own)"
    ),
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# the pool entries a layer's KV lives in (CausalLM.kv_slab): the model's own ("target",
# "draft") and its sliding-window entry ("target.window", "draft.window": pool.window)
MAIN, WINDOW = "main", "window"
# per-layer attention kinds (transformers' ``layer_types``) of the attention families
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
# per-layer kinds of the recurrent hybrids: gated DeltaNet ("linear_attention", transformers'
# name in Qwen3-Next) and Mamba2 ("mamba") hold a per-sequence state slot; "mlp" and "moe"
# layers (Nemotron-H) mix no tokens and hold nothing
RECURRENT_LAYER_TYPES = ("linear_attention", "mamba")


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
class DeltaNetConfig:
    """Gated DeltaNet layers (Qwen3-Next, Qwen3.5): see :mod:`backends.runtime.recurrent`."""

    num_k_heads: int
    num_v_heads: int  # a multiple of num_k_heads: each key head serves several value heads
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: ``[q | k | v]``."""
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim

    def state_segments(self) -> tuple[tuple[str, int, int], ...]:
        """A layer's state slot, in order: (name, heads, elements per head) per sub-block."""
        w = self.conv_kernel - 1
        return (
            ("conv_q", self.num_k_heads, self.k_head_dim * w),
            ("conv_k", self.num_k_heads, self.k_head_dim * w),
            ("conv_v", self.num_v_heads, self.v_head_dim * w),
            ("recurrent", self.num_v_heads, self.k_head_dim * self.v_head_dim),
        )


@dataclass(frozen=True)
class Mamba2Config:
    """Mamba2 layers (Nemotron-H): see :mod:`backends.runtime.recurrent.mamba2`."""

    num_heads: int
    head_dim: int
    n_groups: int  # B and C are shared by num_heads / n_groups heads
    state_size: int
    conv_kernel: int
    chunk_size: int
    dt_min: float = 0.0  # the chunked form clamps dt to >= this (as transformers does)
    norm_eps: float = 1e-5

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: ``[x | B | C]``."""
        return self.num_heads * self.head_dim + 2 * self.n_groups * self.state_size

    def state_segments(self) -> tuple[tuple[str, int, int], ...]:
        """A layer's state slot, in order: (name, heads or groups, elements per one). B and C
        split by group (a group's heads share them)."""
        H, P, G, N = self.num_heads, self.head_dim, self.n_groups, self.state_size
        conv = [("conv_x", H, P), ("conv_B", G, N), ("conv_C", G, N)]  # channels per one
        return (*((n, h, c * (self.conv_kernel - 1)) for n, h, c in conv), ("ssm", H, P * N))


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
    sliding_window: int | None = None  # keys per query of a sliding layer (see layer_window)
    # per layer "full_attention" | "sliding_attention" (Gemma 3, gpt-oss, Qwen3 with
    # max_window_layers); empty: every layer windowed by sliding_window, or none (Mistral)
    layer_types: tuple[str, ...] = ()
    rope_local: RopeConfig | None = None  # the sliding layers' rotary embedding (Gemma 3)
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" | "gelu_pytorch_tanh" (GeGLU)
    qk_norm: bool = False  # RMSNorm over each head's q and k before the rotation (Qwen3, Gemma 3)
    attn_sinks: bool = False  # a learned logit per head in every softmax's denominator (gpt-oss)
    query_pre_attn_scalar: float | None = None  # softmax scale = its -1/2 power (Gemma 3)
    embedding_multiplier: float = 1.0  # token embeddings times this (Gemma 3: sqrt(hidden))
    final_logit_softcapping: float | None = None  # logits = c * tanh(logits / c) (Gemma 3)
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
    # the MoE layers where they follow no DeepSeek rule (Qwen3-MoE's decoder_sparse_step and
    # mlp_only_layers, gpt-oss: every layer); None: first_k_dense_replace / moe_layer_freq
    moe_layers: tuple[int, ...] | None = None
    # gpt-oss experts: up clamped to [-limit, limit], gate to <= limit, gate * sigmoid(alpha gate)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # the recurrent hybrids' token mixers (layer_types "linear_attention" / "mamba")
    deltanet: DeltaNetConfig | None = None
    mamba: Mamba2Config | None = None
    # Granite 4.0-H: each block's output times residual_multiplier before its residual add,
    # logits divided by logits_scaling, the softmax scale attention_multiplier; "none": its
    # attention layers (and Nemotron-H's) rotate nothing
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    attention_multiplier: float | None = None
    position_embedding: str = "rope"  # "rope" | "none"

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
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
            )

    @property
    def softmax_scale(self) -> float:
        """Attention score scale, with DeepSeek's YaRN ``mscale_all_dim`` correction."""
        if self.query_pre_attn_scalar is not None:
            return float(self.query_pre_attn_scalar) ** -0.5
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        scale = self.head_dim**-0.5
        r = self.rope
        if self.attn == "mla" and r.type != "default" and r.mscale_all_dim:
            m = yarn_mscale(r.factor, r.mscale_all_dim)
            scale = scale * m * m
        return scale

    def layer_window(self, layer: int) -> int | None:
        """Keys per query of layer ``layer``'s attention (query i sees keys (i - w, i]), or None:
        every earlier key."""
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    def layer_rope(self, layer: int) -> RopeConfig:
        """The rotary embedding of layer ``layer`` (Gemma 3's sliding layers have their own)."""
        if self.rope_local is not None and self.layer_window(layer) is not None:
            return self.rope_local
        return self.rope

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers with attention, in order: the KV pool's layer ``j`` is model layer
        ``kv_layers[j]`` (every layer but a hybrid's recurrent and MLP-only ones)."""
        kinds = self.layer_types or ("full_attention",) * self.num_layers
        return tuple(i for i, t in enumerate(kinds) if t in ATTENTION_LAYER_TYPES)

    @property
    def window_kv_layers(self) -> tuple[int, ...]:
        """The sliding-window layers whose KV lives in a pool entry of its own
        (``{model}.window``, see :mod:`backends.runtime.window`): those of a model that mixes
        sliding and full-attention layers (Gemma 3, gpt-oss). Empty when every attention layer
        slides (Mistral) or none does: one entry holds them all, as ever."""
        sliding = tuple(i for i in self.kv_layers if self.layer_window(i) is not None)
        return sliding if len(sliding) < len(self.kv_layers) else ()

    @property
    def full_kv_layers(self) -> tuple[int, ...]:
        """The layers whose KV lives in the model's own entry: every attention layer but
        :attr:`window_kv_layers`."""
        window = set(self.window_kv_layers)
        return tuple(i for i in self.kv_layers if i not in window)

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        """The layers holding a per-sequence state slot (gated DeltaNet, Mamba2), in order."""
        return tuple(i for i, t in enumerate(self.layer_types) if t in RECURRENT_LAYER_TYPES)

    @property
    def has_recurrent_state(self) -> bool:
        """Whether a sequence's context lives partly in a recurrent state rather than in pages:
        such a model cannot share or roll back a prefix by pages (prefix caching and speculative
        decoding refuse it)."""
        return bool(self.recurrent_layers)

    def is_moe_layer(self, layer: int) -> bool:
        if self.moe_layers is not None:
            return layer in self.moe_layers
        return (
            self.n_routed_experts > 0
            and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0
        )

    def truncated(self, num_layers: int) -> ModelConfig:
        """The same model cut to its first ``num_layers`` decoder layers (a self-draft)."""
        if not 0 < num_layers <= self.num_layers:
            raise ValueError(f"num_layers must be in [1, {self.num_layers}], got {num_layers}")
        return replace(self, num_layers=num_layers, layer_types=self.layer_types[:num_layers])

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
        refused = next((a for a in archs if a in REFUSED_ARCHITECTURES), None)
        if arch is None and refused is not None:
            raise UnsupportedArchitectureError(f"{refused}: {REFUSED_ARCHITECTURES[refused]}")
        if arch is None:
            raise UnsupportedArchitectureError(
                f"unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if arch == "NemotronHForCausalLM":
            raw = _nemotron_h_raw(raw)
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
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
            hidden_act=act,
        )
        if arch in HYBRID_ARCHITECTURES:
            return cls(**{**common, **_HYBRID_FIELDS[arch](raw)})
        if arch in GQA_ARCHITECTURES:
            family = _FAMILY_FIELDS.get(arch)
            extra = family(raw) if family is not None else {}
            return cls(**{**common, **_gqa_fields(raw, arch), **extra})
        common["num_kv_heads"] = heads  # MLA: every head reads the same latent
        return cls(**common, **_mla_fields(raw, arch))


# Qwen's configs carry a sliding_window that applies only with use_sliding_window
USE_SLIDING_FLAG = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# the sliding layers of these are the ones from max_window_layers on (or their layer_types);
# Mistral's window is on every layer (transformers ignores a Mistral config's layer_types)
MAX_WINDOW_LAYERS = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")


def _gqa_fields(raw: dict, arch: str) -> dict:
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    window = raw.get("sliding_window")
    if arch in USE_SLIDING_FLAG and not raw.get("use_sliding_window", False):
        window = None
    bias = bool(raw.get("attention_bias", False))
    return dict(
        attn="gqa",
        head_dim=head_dim,
        rope=_rope(raw, head_dim, "half"),
        qkv_bias=bias or arch == "Qwen2ForCausalLM",
        o_bias=bias,
        sliding_window=window,
        layer_types=_qwen_layer_types(raw) if arch in MAX_WINDOW_LAYERS else (),
    )


def _qwen_layer_types(raw: dict) -> tuple[str, ...]:
    """Qwen2/Qwen3: the config's layer_types; older configs name the sliding layers by
    ``max_window_layers`` (the layers from it on, when use_sliding_window)."""
    if raw.get("layer_types") is None and raw.get("use_sliding_window"):
        n = raw["num_hidden_layers"]
        first = raw.get("max_window_layers", n)
        return tuple("sliding_attention" if i >= first else "full_attention" for i in range(n))
    return _layer_types(raw, None)


def _layer_types(raw: dict, sliding_every: int | None) -> tuple[str, ...]:
    """The checkpoint's ``layer_types``, else every ``sliding_every``-th layer full and the
    others sliding (Gemma 3's older ``sliding_window_pattern``, gpt-oss's alternation), else ()."""
    n = raw["num_hidden_layers"]
    types = raw.get("layer_types")
    if types is None and sliding_every is not None:
        full = [(i + 1) % sliding_every == 0 for i in range(n)]
        types = ["full_attention" if f else "sliding_attention" for f in full]
    if types is None:
        return ()
    bad = sorted(set(types) - set(ATTENTION_LAYER_TYPES))
    if bad:
        raise UnsupportedArchitectureError(
            f"layer_types {bad} not supported here; supported: {', '.join(ATTENTION_LAYER_TYPES)}"
        )
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for {n} layers")
    return tuple(types)


def _qwen3_fields(raw: dict) -> dict:
    """Qwen3: q/k norms."""
    return dict(qk_norm=True)


def _qwen3_moe_fields(raw: dict) -> dict:
    """Qwen3-MoE: q/k norms (its sliding window, if on, is on every layer); MoE on the layers
    ``(i + 1) % decoder_sparse_step == 0`` not in ``mlp_only_layers``; no shared experts."""
    n, step = raw["num_hidden_layers"], raw.get("decoder_sparse_step", 1) or 1
    dense = set(raw.get("mlp_only_layers") or ())
    experts = raw.get("num_experts") or raw.get("num_local_experts") or 0  # (5.x writes this)
    moe = tuple(i for i in range(n) if experts and i not in dense and (i + 1) % step == 0)
    return dict(
        qk_norm=True,
        layer_types=(),
        n_routed_experts=experts,
        num_experts_per_tok=raw.get("num_experts_per_tok") or 0,
        moe_intermediate_size=raw.get("moe_intermediate_size") or 0,
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        moe_layers=moe,
    )


def _gemma3_fields(raw: dict) -> dict:
    """Gemma 3 text: see the module docstring. The rotary parameters per layer kind come as
    transformers 5 writes them (``rope_parameters`` keyed by layer type) or as older configs
    do (``rope_theta`` + ``rope_scaling`` for the global layers, ``rope_local_base_freq``)."""
    if raw.get("use_bidirectional_attention"):
        raise UnsupportedArchitectureError(
            "Gemma 3 with use_bidirectional_attention (an encoder) is not supported"
        )
    if raw.get("attn_logit_softcapping") is not None:
        raise UnsupportedArchitectureError(
            "attn_logit_softcapping is not supported by the runtime's attention kernels"
        )
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(raw, rope_parameters=params.get("full_attention") or {}, rope_scaling=None)
        local = dict(raw, rope_parameters=params.get("sliding_attention") or {}, rope_scaling=None)
    else:
        full = dict(raw, rope_theta=raw.get("rope_theta", 1_000_000.0))
        local = dict(
            raw,
            rope_parameters={},
            rope_scaling=None,
            rope_theta=raw.get("rope_local_base_freq", 10_000.0),
        )
    cap = raw.get("final_logit_softcapping")
    return dict(
        head_dim=head_dim,
        rope=_rope(full, head_dim, "half", default_theta=1_000_000.0),
        rope_local=_rope(local, head_dim, "half", default_theta=10_000.0),
        sliding_window=raw.get("sliding_window", 4096),
        layer_types=_layer_types(raw, raw.get("sliding_window_pattern", 6)),
        qk_norm=True,
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
        embedding_multiplier=float(raw["hidden_size"]) ** 0.5,
        final_logit_softcapping=None if cap is None else float(cap),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
    )


def _gpt_oss_fields(raw: dict) -> dict:
    """gpt-oss: see the module docstring."""
    quant = raw.get("quantization_config") or {}
    if quant.get("quant_method"):
        raise UnsupportedArchitectureError(
            f"gpt-oss with {quant['quant_method']!r}-quantized weights is not supported: load a "
            f"checkpoint with the experts dequantized to bfloat16 (e.g. transformers' "
            f"Mxfp4Config(dequantize=True), then save_pretrained)"
        )
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    bias = bool(raw.get("attention_bias", True))
    n = raw["num_hidden_layers"]
    return dict(
        head_dim=head_dim,
        rope=_rope(raw, head_dim, "half", default_theta=150_000.0),
        qkv_bias=bias,
        o_bias=bias,
        sliding_window=raw.get("sliding_window", 128),
        layer_types=_layer_types(raw, 2),
        attn_sinks=True,
        n_routed_experts=raw.get("num_local_experts") or raw.get("num_experts") or 0,
        num_experts_per_tok=raw.get("num_experts_per_tok") or raw.get("experts_per_token") or 0,
        moe_intermediate_size=raw["intermediate_size"],
        moe_layers=tuple(range(n)),
        swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
    )


_FAMILY_FIELDS = {
    "Qwen3ForCausalLM": _qwen3_fields,
    "Qwen3MoeForCausalLM": _qwen3_moe_fields,
    "Gemma3ForCausalLM": _gemma3_fields,
    "GptOssForCausalLM": _gpt_oss_fields,
}


def _hybrid_types(types, n: int, allowed: tuple[str, ...]) -> tuple[str, ...]:
    if len(types) != n:
        raise ValueError(f"layer types name {len(types)} layers, the model has {n}")
    bad = sorted(set(types) - set(allowed))
    if bad:
        raise UnsupportedArchitectureError(
            f"layer types {bad} not supported here; supported: {', '.join(allowed)}"
        )
    return tuple(types)


def _qwen3_next_fields(raw: dict) -> dict:
    """Qwen3-Next, Qwen3.5 and Qwen3.5-MoE text: gated DeltaNet layers ("linear_attention")
    and, every ``full_attention_interval``-th, gated attention (an output gate from q_proj,
    ``(1 + w)`` q/k norms, rotary on the first ``partial_rotary_factor`` of each head). MoE
    (softmax top-k, renormalised, plus a sigmoid-gated shared expert) on the layers
    ``(i + 1) % decoder_sparse_step == 0`` not in ``mlp_only_layers``; Qwen3.5: dense MLPs."""
    n, heads = raw["num_hidden_layers"], raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    every = raw.get("full_attention_interval", 4)
    default = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    kinds = ("full_attention", "linear_attention")
    types = _hybrid_types(raw.get("layer_types") or default, n, kinds)
    experts = raw.get("num_experts") or raw.get("num_local_experts") or 0  # (5.x writes this)
    step, dense = raw.get("decoder_sparse_step", 1) or 1, set(raw.get("mlp_only_layers") or ())
    bias = bool(raw.get("attention_bias", False))
    return dict(
        attn="gqa",
        head_dim=head_dim,
        rope=_rope(raw, head_dim, "half", partial=True),
        qkv_bias=bias,
        o_bias=bias,
        layer_types=types,
        qk_norm=True,
        n_routed_experts=experts,
        num_experts_per_tok=raw.get("num_experts_per_tok") or 0,
        moe_intermediate_size=raw.get("moe_intermediate_size") or 0,
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        moe_layers=tuple(i for i in range(n) if experts and i not in dense and (i + 1) % step == 0),
        deltanet=DeltaNetConfig(
            num_k_heads=raw["linear_num_key_heads"],
            num_v_heads=raw["linear_num_value_heads"],
            k_head_dim=raw["linear_key_head_dim"],
            v_head_dim=raw["linear_value_head_dim"],
            conv_kernel=raw.get("linear_conv_kernel_dim", 4),
        ),
    )


# Nemotron-H's block kinds: transformers' names (its older pattern letters M - * E)
NEMOTRON_H_TYPES = {"linear_attention": "mamba", "mlp": "mlp", "full_attention": "full_attention"}
NEMOTRON_H_PATTERN = {"M": "linear_attention", "-": "mlp", "*": "full_attention", "E": "moe"}


def _nemotron_h_raw(raw: dict) -> dict:
    """Nemotron-H's config under the common names: the layer count from its block kinds
    (``layers_block_type``, or the older ``hybrid_override_pattern``), ``layer_norm_epsilon``."""
    kinds = raw.get("layers_block_type") or raw.get("layer_types")
    if kinds is None:
        kinds = [NEMOTRON_H_PATTERN.get(c, c) for c in raw.get("hybrid_override_pattern", "")]
    return dict(
        raw,
        layers_block_type=list(kinds),
        num_hidden_layers=len(kinds),
        rms_norm_eps=raw.get("layer_norm_epsilon", raw.get("rms_norm_eps", 1e-5)),
        intermediate_size=raw.get("intermediate_size") or 0,
    )


def _nemotron_h_fields(raw: dict) -> dict:
    """Nemotron-H: Mamba2 layers, attention layers (no rotary: position comes from the Mamba2
    layers) and MLP-only layers (``relu(x) ** 2``, no gate), each a pre-norm residual block."""
    n, heads = raw["num_hidden_layers"], raw["num_attention_heads"]
    kinds = raw["layers_block_type"]
    if "moe" in kinds:
        raise UnsupportedArchitectureError(
            "Nemotron-H mixture-of-experts layers ('moe', pattern 'E') are not supported"
        )
    kinds = _hybrid_types(kinds, n, tuple(NEMOTRON_H_TYPES))
    if raw.get("mlp_hidden_act", "relu2") != "relu2":
        raise UnsupportedArchitectureError(
            f"Nemotron-H mlp_hidden_act {raw['mlp_hidden_act']!r} not supported; supported: relu2"
        )
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    bias = bool(raw.get("attention_bias", False))
    return dict(
        attn="gqa",
        head_dim=head_dim,
        rope=_rope(raw, head_dim, "half"),  # unused: no rotary in Nemotron-H attention
        qkv_bias=bias,
        o_bias=bias,
        layer_types=tuple(NEMOTRON_H_TYPES[k] for k in kinds),
        position_embedding="none",
        mamba=Mamba2Config(
            num_heads=raw.get("mamba_num_heads", 128),
            head_dim=raw.get("mamba_head_dim", 64),
            n_groups=raw.get("n_groups", raw.get("mamba_n_groups", 8)),
            state_size=raw.get("ssm_state_size", 128),
            conv_kernel=raw.get("conv_kernel", raw.get("mamba_d_conv", 4)),
            chunk_size=raw.get("chunk_size", raw.get("mamba_chunk_size", 128)),
            dt_min=float(raw.get("time_step_min", raw.get("mamba_dt_min", 0.001))),
            norm_eps=float(raw["rms_norm_eps"]),
        ),
    )


def _granite_hybrid_fields(raw: dict) -> dict:
    """Granite 4.0-H: Mamba2 layers ("linear_attention", older "mamba") and GQA attention layers,
    rotary only with ``position_embedding_type: rope``; each layer a pre-norm residual block of
    its mixer and then a top-k MoE (softmax over the k best router logits) plus a shared SwiGLU
    MLP, both blocks' outputs times ``residual_multiplier``; embeddings times
    ``embedding_multiplier``, logits divided by ``logits_scaling``."""
    n, heads, hidden = raw["num_hidden_layers"], raw["num_attention_heads"], raw["hidden_size"]
    kinds = {"linear_attention": "mamba", "mamba": "mamba"}
    default = ["linear_attention"] * n
    types = raw.get("layer_types") or raw.get("layers_block_type") or default
    types = tuple(kinds.get(t, "full_attention") for t in _hybrid_types(types, n, GRANITE_TYPES))
    mamba_heads = raw.get("mamba_n_heads", 128)
    mamba_head_dim = raw.get("mamba_d_head", "auto")
    if mamba_head_dim == "auto":
        mamba_head_dim = raw.get("mamba_expand", 2) * hidden // mamba_heads
    limit = raw.get("time_step_limit") or (0.0, None)
    head_dim = raw.get("head_dim") or hidden // heads
    bias = bool(raw.get("attention_bias", False))
    return dict(
        attn="gqa",
        head_dim=head_dim,
        rope=_rope(raw, head_dim, "half"),
        qkv_bias=bias,
        o_bias=bias,
        layer_types=types,
        position_embedding="rope" if raw.get("position_embedding_type") == "rope" else "none",
        embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(raw.get("residual_multiplier", 1.0)),
        logits_scaling=float(raw.get("logits_scaling", 1.0)),
        attention_multiplier=float(raw.get("attention_multiplier", head_dim**-0.5)),
        n_routed_experts=raw.get("num_local_experts") or 0,
        num_experts_per_tok=raw.get("num_experts_per_tok") or 0,
        moe_intermediate_size=raw["intermediate_size"],
        mamba=Mamba2Config(
            num_heads=mamba_heads,
            head_dim=mamba_head_dim,
            n_groups=raw.get("mamba_n_groups", 1),
            state_size=raw.get("mamba_d_state", 256),
            conv_kernel=raw.get("mamba_d_conv", 4),
            chunk_size=raw.get("mamba_chunk_size", 256),
            dt_min=float(limit[0] or 0.0),
            norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        ),
    )


# Granite 4.0-H's layer kinds as transformers 5 names them, and the older names
GRANITE_TYPES = ("linear_attention", "full_attention", "mamba", "attention")

_HYBRID_FIELDS = {
    "GraniteMoeHybridForCausalLM": _granite_hybrid_fields,
    "Qwen3NextForCausalLM": _qwen3_next_fields,
    "Qwen3_5ForCausalLM": _qwen3_next_fields,
    "Qwen3_5MoeForCausalLM": _qwen3_next_fields,
    "NemotronHForCausalLM": _nemotron_h_fields,
}


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


def _rope(
    raw: dict, dim: int, style: str, default_theta: float = 10000.0, partial: bool = False
) -> RopeConfig:
    """``partial``: the family rotates only the first ``partial_rotary_factor`` of each head's
    channels (RopeConfig.dim is then that many); otherwise a factor != 1 is refused."""
    params = dict(raw.get("rope_parameters") or {})
    legacy = raw.get("rope_scaling") or {}
    for k, v in legacy.items():
        params.setdefault(k, v)
    theta = params.get("rope_theta", raw.get("rope_theta", default_theta))
    rtype = params.get("rope_type") or params.get("type") or "default"
    if rtype not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedArchitectureError(
            f"rope type {rtype!r} not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    fraction = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    if fraction != 1.0 and not partial:
        raise UnsupportedArchitectureError("partial_rotary_factor != 1 is not supported")
    dim = int(dim * fraction)
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
