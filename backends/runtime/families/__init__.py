"""Model families: each architecture's decoder layers and final norm, built from the shared
blocks (:mod:`~backends.runtime.attention`, :mod:`~backends.runtime.layers`).

A family is a module with two builders, which :class:`~backends.runtime.model.CausalLM` calls:

* ``build_layer(cfg, w, i, rope, kernels)``: decoder layer ``i`` (its rotary embedding ``rope``:
  ``cfg.layer_rope(i)``'s), callable as ``layer(h [T, hidden], meta, kv, rows) -> h``, with its
  token mixer ``.attn`` (or ``.mixer``), whose out projection is ``.o``, and its feed-forward
  parts (``.mlp``; Granite 4.0-H's ``.moe`` and ``.shared``), which tensor parallelism wraps;
* ``build_norm(cfg, w, kernels)``: the final norm.

The config (:mod:`~backends.runtime.config`) parses every family's fields; a family module only
assembles blocks. Families: :mod:`.llama` (Llama, Mistral, Qwen2, DeepSeek V2/V3), :mod:`.qwen3`
(Qwen3, Qwen3-MoE), :mod:`.gemma3` (Gemma 3 text), :mod:`.gpt_oss` (gpt-oss); the recurrent
hybrids :mod:`.qwen3_next` (Qwen3-Next, Qwen3.5, Qwen3.5-MoE: gated DeltaNet),
:mod:`.nemotron_h` (Nemotron-H) and :mod:`.granite_hybrid` (Granite 4.0-H: Mamba2), whose
recurrent layers keep a state slot per sequence (:mod:`backends.runtime.state_pool`) and take
no KV: ``kv`` is None for them.
"""

from __future__ import annotations

from types import ModuleType

from ..config import ModelConfig, UnsupportedArchitectureError
from . import gemma3, gpt_oss, granite_hybrid, llama, nemotron_h, qwen3, qwen3_next

FAMILIES: dict[str, ModuleType] = {
    "LlamaForCausalLM": llama,
    "MistralForCausalLM": llama,
    "Qwen2ForCausalLM": llama,
    "DeepseekV2ForCausalLM": llama,
    "DeepseekV3ForCausalLM": llama,
    "Qwen3ForCausalLM": qwen3,
    "Qwen3MoeForCausalLM": qwen3,
    "Gemma3ForCausalLM": gemma3,
    "GptOssForCausalLM": gpt_oss,
    "Qwen3NextForCausalLM": qwen3_next,
    "Qwen3_5ForCausalLM": qwen3_next,
    "Qwen3_5MoeForCausalLM": qwen3_next,
    "NemotronHForCausalLM": nemotron_h,
    "GraniteMoeHybridForCausalLM": granite_hybrid,
}


def family_of(cfg: ModelConfig) -> ModuleType:
    """The family module that builds ``cfg``'s model."""
    try:
        return FAMILIES[cfg.architecture]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"no model family builds {cfg.architecture!r}; families: {', '.join(FAMILIES)}"
        ) from None
