"""Models the TTFT benchmark runs: the default checkpoint and a KV-heavy random MHA Llama.

The KV-heavy model has as many KV heads as query heads (MHA) and a narrow MLP, so it writes more
KV bytes per FLOP than SmolLM2 (GQA 9:3, wide MLP): the regime where the transfer matters most.
It is built with transformers from a config (random weights, like tests/helpers/runtime_models.py)
once per directory and reused.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from benchmarks import ROOT

DEFAULT_MODEL = ROOT / "models" / "smollm2-135m-instruct"
KV_HEAVY_DIR = ROOT / "bench_out" / "models" / "kv-heavy-mha"

# Llama, MHA: 8 heads x 64 dim = 8 KV heads; KV per token = 12 layers x 2 x 512 x 4 B = 48 KiB
KV_HEAVY = dict(
    vocab_size=2048,
    hidden_size=512,
    intermediate_size=768,
    num_hidden_layers=12,
    num_attention_heads=8,
    num_key_value_heads=8,
    max_position_embeddings=16384,
    initializer_range=0.05,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=True,
)


def kv_heavy_checkpoint(path: Path = KV_HEAVY_DIR) -> str:
    """Directory of the KV-heavy random checkpoint (built on first use, float32 safetensors)."""
    cfg_file = path / "config.json"
    if cfg_file.exists():
        have = json.loads(cfg_file.read_text())
        if all(have.get(k) == v for k, v in KV_HEAVY.items() if k != "initializer_range"):
            _copy_tokenizer(path)
            return str(path)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    model = LlamaForCausalLM(LlamaConfig(**KV_HEAVY)).eval()
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(str(path))
    _copy_tokenizer(path)
    return str(path)


def _copy_tokenizer(path: Path) -> None:
    """The serving stages (pre/postprocess) need a tokenizer: borrow SmolLM2's. The benchmark
    sends token ids < vocab_size, and those ids decode fine with it."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not (path / name).exists() and (DEFAULT_MODEL / name).exists():
            shutil.copy(DEFAULT_MODEL / name, path / name)


def resolve(name: str) -> str:
    """'default' | 'kv-heavy' | a checkpoint directory -> checkpoint directory."""
    if name == "default":
        return str(DEFAULT_MODEL)
    if name == "kv-heavy":
        return kv_heavy_checkpoint()
    if not os.path.isfile(os.path.join(name, "config.json")):
        raise SystemExit(f"--models: {name!r} is neither 'default', 'kv-heavy' nor a checkpoint")
    return name


def kv_bytes_per_token(path: str, dtype_bytes: int = 4) -> int:
    """KV bytes one prompt token occupies in the pool (all layers, K and V)."""
    from backends.runtime.config import ModelConfig

    c = ModelConfig.from_pretrained(path)
    if c.attn == "gqa":
        return c.num_layers * 2 * c.num_kv_heads * c.head_dim * dtype_bytes
    return c.num_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * dtype_bytes
