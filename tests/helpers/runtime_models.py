"""Tiny random checkpoints (written with transformers ``save_pretrained``) for runtime tests.

Each is built once per test session into a temporary directory. ``initializer_range`` is large
(0.15) so greedy outputs vary from token to token and logit ties are unlikely.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile

import torch

_ROOT = tempfile.mkdtemp(prefix="runtime_models_")
atexit.register(shutil.rmtree, _ROOT, True)

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    max_position_embeddings=512,
    initializer_range=0.15,
    bos_token_id=1,
    eos_token_id=2,
)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        **COMMON,
        num_key_value_heads=2,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg)


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**COMMON, num_key_value_heads=1, tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg)


def _qwen2_kv2():
    """Qwen2 with 2 KV heads (of 4): split one KV head per rank at tensor parallel size 2."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**COMMON, num_key_value_heads=2, tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg)


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(
        **COMMON,
        num_key_value_heads=2,
        sliding_window=16,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    )
    return MistralForCausalLM(cfg)


MLA = dict(
    COMMON,
    moe_intermediate_size=32,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
)


def _deepseek_v3():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        **MLA, n_routed_experts=8, n_group=2, topk_group=1, q_lora_rank=24, num_key_value_heads=4
    )
    return DeepseekV3ForCausalLM(cfg)


def _deepseek_v2():
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    cfg = DeepseekV2Config(
        **MLA,
        n_routed_experts=6,
        q_lora_rank=None,
        topk_method="greedy",
        routed_scaling_factor=1.5,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    )
    return DeepseekV2ForCausalLM(cfg)


BUILDERS = {
    "llama": _llama,
    "qwen2": _qwen2,
    "qwen2_kv2": _qwen2_kv2,
    "mistral": _mistral,
    "deepseek_v3": _deepseek_v3,
    "deepseek_v2": _deepseek_v2,
}


@functools.cache
def checkpoint(kind: str) -> str:
    """Directory of the tiny ``kind`` checkpoint (built on first use)."""
    torch.manual_seed(1234)
    model = BUILDERS[kind]().eval()
    with torch.no_grad():  # exercise the bias path of V3 routing
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.1)
    path = f"{_ROOT}/{kind}"
    model.save_pretrained(path)
    return path


@functools.cache
def hf_model(kind: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint(kind), dtype=torch.float32).eval()


def hf_greedy(kind: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    return greedy_generate(hf_model(kind), prompt, max_new_tokens)


def greedy_generate(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of ``prompt`` (no EOS stop: pad id 0)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


# the device the runtime's oracle tests run on (scripts/gpu_check.sh sets cuda); the
# transformers references always run on the CPU in float32
DEVICE = os.environ.get("PD_TEST_DEVICE", "cpu")


def assert_close_to_reference(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Runtime logits vs the CPU reference: float32 sums in another order on a GPU."""
    tol = 1e-4 if DEVICE == "cpu" else 2e-3
    torch.testing.assert_close(got.float().cpu(), ref.float().cpu(), atol=tol, rtol=tol)


def random_prompt(n: int, seed: int, vocab: int = 256) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def assert_greedy_generate_matches(kind: str, runner, seed: int, n: int = 32) -> list[int]:
    """The runtime engine's greedy continuation of a random prompt equals transformers'
    token for token (all ``n`` tokens: no early EOS, not a degenerate repetition)."""
    from backends.runtime.engine import LLMEngine
    from backends.runtime.sampler import SamplingParams

    prompt = random_prompt(5 + 4 * seed, seed=seed)
    expected = hf_greedy(kind, prompt, n)
    engine = LLMEngine(runner, runner.make_pool(32, 8), max_batch=4)
    (seq,) = engine.generate([(prompt, SamplingParams(max_tokens=n))])
    assert seq.output_ids == expected
    assert len(expected) == n and len(set(expected)) > 8
    return expected


# float16 / bfloat16 oracles: transformers in the same dtype rounds in other places than the
# runtime, so greedy paths may part where its own top two logits (nearly) tie. Measured on the
# tiny models (seeds 0 and 7, 32 tokens): float16 parted once, at a margin of 0.0039.
HALF_TIE = 0.02
BF16_TIE = 0.125  # bfloat16 keeps 8 bits: one unit in the last place of a logit near 16


def assert_greedy_matches_up_to_tie(
    model, prompt: list[int], got: list[int], want: list[int], tie: float = HALF_TIE
):
    """``got`` (the runtime's greedy tokens) equals ``want`` (``model``'s) up to the first
    position where they differ, and there ``model``'s logits of the two tokens tie within
    ``tie``. -> the number of equal tokens."""
    assert len(got) == len(want)
    i = next((j for j, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
    if i is None:
        return len(got)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + want[:i]])).logits[0, -1].float()
    margin = float(logits[want[i]] - logits[got[i]])
    # either sign: this whole-prompt forward rounds otherwise than the reference's cached
    # decode, which chose want[i] (seen: bfloat16 SmolLM2, -0.125, one unit in the last place)
    assert abs(margin) <= tie, f"token {i}: {got[i]} vs reference {want[i]}, margin {margin}"
    return i


def forward_vs_transformers(kind: str, runner, n: int = 21) -> tuple[list[int], torch.Tensor]:
    """One runtime forward over a random ``n``-token prompt, checked against transformers'
    logits; -> (the prompt, transformers' logits [n, V])."""
    from backends.runtime.paged import SeqInput

    prompt = random_prompt(n, seed=1)
    with torch.no_grad():
        ref = hf_model(kind)(torch.tensor([prompt])).logits[0].float()  # [T, V]
    pool = runner.make_pool(16, 4)
    logits = runner.forward(pool, [SeqInput(prompt, 0, pool.alloc(pool.pages_needed(n)))])[0]
    assert logits.shape == ref.shape  # (TP: the vocabulary shards gathered and cut to V)
    assert_close_to_reference(logits, ref)
    return prompt, ref
