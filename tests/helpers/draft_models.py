"""A tiny random MLA target (DeepSeek-V3) with a tiny random GQA draft (Llama) that agree often.

Independent random models never agree (acceptance 0), which leaves the accept path of an MLA
target + GQA draft untested. Here the target's attention / MLP outputs are scaled down (x0.02)
so its next token leans on the current token's embedding, and the draft shares the target's
embedding, final norm and LM head with layers of its own (outputs x0.01, so the draft's KV still
matters): greedy agreement is roughly 50%. Both are written with transformers
``save_pretrained`` (vocab 256, as in :mod:`runtime_models`).
"""

from __future__ import annotations

import functools
import os

import torch
from runtime_models import _ROOT, COMMON, _deepseek_v3, greedy_generate

TARGET_SCALE, DRAFT_SCALE = 0.02, 0.01


def _scale_outputs(model, scale: float) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "o_proj" in name or "down_proj" in name:  # attention + MLP / expert outputs
                p.mul_(scale)


@functools.cache
def mla_target_gqa_draft() -> tuple[str, str]:
    """(target checkpoint dir, draft checkpoint dir)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    target = _deepseek_v3().eval()
    _scale_outputs(target, TARGET_SCALE)
    torch.manual_seed(7)
    cfg = LlamaConfig(
        **{**COMMON, "num_hidden_layers": 2}, num_key_value_heads=2, tie_word_embeddings=False
    )
    draft = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        draft.lm_head.weight.copy_(target.lm_head.weight)
        draft.model.norm.weight.copy_(target.model.norm.weight)
    _scale_outputs(draft, DRAFT_SCALE)
    paths = os.path.join(_ROOT, "mla_target"), os.path.join(_ROOT, "gqa_draft")
    target.save_pretrained(paths[0])
    draft.save_pretrained(paths[1])
    return paths


@functools.cache
def _hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy_at(path: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of ``prompt`` by the checkpoint at ``path``."""
    return greedy_generate(_hf(path), prompt, max_new_tokens)
