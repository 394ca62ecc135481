"""Moderate random hybrid checkpoints for the measured parts: a Qwen3-Next-shaped and a
Nemotron-H-shaped model, built with transformers from a config (random weights) and saved as
safetensors, so our runtime loads them as it loads a real checkpoint.

Scaled so a prefill of 1-2K tokens takes about a second on one thread of the 2-core machine
(measured 2026-11-28 at load 1: 0.8 / 1.8 s for the Qwen3-Next-shaped one at 1K / 2K tokens,
0.5 / 1.0 s for the Nemotron-H-shaped one), and so their state stays of the flagships' order
against their KV (the prompt at which the state's bytes equal the KV's: Qwen3-Next-80B in
bfloat16 about 3.2K tokens, this one in float32 about 0.8K; Nemotron-Nano-9B-v2 about 9K, this
one about 1.6K). Their recurrent layers keep the flagships' head shapes (DeltaNet 128 x 128 per
value head, Mamba2 state 128), with fewer heads and a narrow hidden size.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# both: a narrow width, random weights of std 0.05, float32
BASE = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=16384, initializer_range=0.05,
            bos_token_id=1, eos_token_id=2)  # fmt: skip
# Qwen3-Next's layer pattern (3 gated DeltaNet, then gated attention), 8 layers, dense MLPs
# (every layer in mlp_only_layers): 6 DeltaNet layers of 4 key / 8 value heads of 128 (0.55 MB of
# float32 state each), 2 attention layers of 2 KV heads x 128 (2 KiB a token each, float32)
QWEN3_NEXT = dict(BASE, num_hidden_layers=8, head_dim=128, linear_num_key_heads=4,
                  linear_num_value_heads=8, linear_key_head_dim=128, linear_value_head_dim=128,
                  linear_conv_kernel_dim=4, full_attention_interval=4,
                  mlp_only_layers=list(range(8)), num_experts=0)  # fmt: skip
# Nemotron-Nano-9B-v2's mix (Mamba2, MLP-only and a few attention layers) in 14 layers: 6 Mamba2
# layers of 16 heads x 64, 2 groups, state 128 (0.53 MB each), 2 attention layers of 2 KV
# heads x 64 (1 KiB a token each), 6 MLP-only layers
NEMOTRON_H_PATTERN = "M-M-M*-M-M-M*-"
NEMOTRON_H = dict(BASE, head_dim=64, mamba_num_heads=16, mamba_head_dim=64, n_groups=2,
                  ssm_state_size=128, conv_kernel=4, chunk_size=128)  # fmt: skip
LETTERS = {"M": "linear_attention", "-": "mlp", "*": "full_attention"}

# --quick's: the same layer patterns at a width that runs in milliseconds
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, head_dim=32)
QWEN3_NEXT_TINY = dict(QWEN3_NEXT, **TINY, num_hidden_layers=4, mlp_only_layers=[0, 1, 2, 3],
                       linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
                       linear_value_head_dim=16)  # fmt: skip
NEMOTRON_H_TINY = dict(NEMOTRON_H, **TINY, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16,
                       chunk_size=16)  # fmt: skip


def _nemotron_h(fields: dict, pattern: str) -> tuple[str, dict]:
    return "NemotronH", dict(fields, layers_block_type=[LETTERS[c] for c in pattern])


SPECS = {
    "qwen3-next-mini": ("Qwen3Next", QWEN3_NEXT),
    "nemotron-h-mini": _nemotron_h(NEMOTRON_H, NEMOTRON_H_PATTERN),
    "qwen3-next-tiny": ("Qwen3Next", QWEN3_NEXT_TINY),
    "nemotron-h-tiny": _nemotron_h(NEMOTRON_H_TINY, "M-*M"),
}
MINI, QUICK = ("qwen3-next-mini", "nemotron-h-mini"), ("qwen3-next-tiny", "nemotron-h-tiny")


def checkpoint(name: str, root: Path) -> str:
    """Directory of the random checkpoint ``name`` under ``root`` (built on first use, float32
    safetensors; rebuilt when its config changed)."""
    family, fields = SPECS[name]
    path = root / name
    stamp = path / "bench_fields.json"
    if stamp.exists() and json.loads(stamp.read_text()) == fields:
        return str(path)
    import torch
    import transformers

    torch.manual_seed(1234)
    config = getattr(transformers, f"{family}Config")(**fields)
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(str(path))
    stamp.write_text(json.dumps(fields))
    return str(path)
