"""The model shapes the benchmark runs, their random weights, and the arithmetic of a step.

Shapes are the published configs of Llama-3.1-8B and Qwen3-8B (bfloat16: 16.1 and 16.4 GB of
weights), and tiny ones of the same families for the CPU smoke run. Weights are random, made on
the device by transformers' own initialisation (normal, std 0.02; norms 1): no checkpoint travels.
The runtime reads the very same tensors (:func:`~backends.runtime.loader.runner_from_tensors`),
so both sides run identical weights and only the runtime's fused copies (QKV, gate/up: about 9 GB
at 8B) are extra.

What a decode step reads (the bandwidth roofline): every weight once, except the embedding table
of which only the batch's rows are read (a tied head reads it whole), plus each sequence's KV over
its context; ``decode_bytes = weight_bytes + batch * context * kv_bytes_per_token``.
What a prefill computes (the matmul roofline): ``2 * layer_params`` FLOPs per token for the
decoder layers' matmuls, ``2 * vocab * hidden`` per sequence for the head on its last position,
and per layer and sequence of L tokens causal attention ``2 * heads * head_dim * L * (L + 1)``
(QK^T and PV over the lower triangle).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LLAMA_8B = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
}
QWEN3_8B = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "tie_word_embeddings": False,
    "attention_bias": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 36,
}
SHAPES = {"llama-3.1-8b": LLAMA_8B, "qwen3-8b": QWEN3_8B}


def shape_config(name: str, tiny: bool) -> dict:
    """The HF-style config dict of shape ``name`` (what a checkpoint's config.json holds);
    ``tiny``: the same family at a size a CPU runs in milliseconds a step (2 layers, hidden 64,
    heads / 8, KV heads / 4, head_dim / 8, the MLP's ratio kept, a 512-token vocabulary)."""
    raw = dict(SHAPES[name])
    if not tiny:
        return raw
    hidden = 64
    raw.update(
        num_hidden_layers=2,
        hidden_size=hidden,
        intermediate_size=raw["intermediate_size"] * hidden // raw["hidden_size"],
        num_attention_heads=raw["num_attention_heads"] // 8,
        num_key_value_heads=raw["num_key_value_heads"] // 4,
        head_dim=raw["head_dim"] // 8,
        vocab_size=512,
        max_position_embeddings=16384,  # above llama3 rope's original 8192
    )
    if "max_window_layers" in raw:
        raw["max_window_layers"] = 2
    return raw


def build_hf_model(raw: dict, dtype: torch.dtype, device: str):
    """transformers' model of config ``raw`` with random weights made on ``device``, eval mode,
    SDPA attention."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {k: v for k, v in raw.items() if k != "model_type"}
    cfg = AutoConfig.for_model(raw["model_type"], **kwargs)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


@dataclass(frozen=True)
class Arithmetic:
    """Bytes and FLOPs of one model (see the module docstring for the formulas)."""

    params: int
    weight_bytes: int  # read by one decode step: all weights but the unread embedding rows
    layer_params: int  # matmul weights of the decoder layers (per-token FLOPs / 2)
    head_params: int  # vocab x hidden
    layers: int
    heads: int
    head_dim: int
    kv_heads: int

    @classmethod
    def of(cls, hf_model) -> Arithmetic:
        cfg = hf_model.config
        named = dict(hf_model.named_parameters())  # tied tensors appear once
        total = sum(p.numel() * p.element_size() for p in named.values())
        embed = hf_model.get_input_embeddings().weight
        tied = hf_model.get_output_embeddings().weight is embed
        layer = sum(p.numel() for n, p in named.items() if ".layers." in n and p.dim() == 2)
        return cls(
            params=sum(p.numel() for p in named.values()),
            weight_bytes=total - (0 if tied else embed.numel() * embed.element_size()),
            layer_params=layer,
            head_params=embed.numel(),
            layers=cfg.num_hidden_layers,
            heads=cfg.num_attention_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            kv_heads=cfg.num_key_value_heads,
        )

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """K and V of one token over every layer, ``itemsize`` bytes an element."""
        return 2 * self.layers * self.kv_heads * self.head_dim * itemsize

    def decode_bytes(self, batch: int, context: int, kv_itemsize: int) -> int:
        return self.weight_bytes + batch * context * self.kv_bytes_per_token(kv_itemsize)

    def prefill_flops(self, batch: int, length: int) -> int:
        attention = 2 * self.heads * self.head_dim * length * (length + 1) * self.layers
        return batch * (2 * self.layer_params * length + 2 * self.head_params + attention)
