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


# the attention families: GQA with 2 KV heads of 16 channels; a sliding window of 16 keys where
# the family has one (the tests' prompts run past it)
FAMILY = dict(COMMON, num_key_value_heads=2, head_dim=16)
WINDOW = 16


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**FAMILY, tie_word_embeddings=False))


def _qwen3_moe():
    """8 experts, top 2 renormalised; layer 1 a dense MLP (mlp_only_layers)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        **FAMILY,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    )
    return Qwen3MoeForCausalLM(cfg)


def _gemma3():
    """Sliding layers 0-2 (window 16, their own rope base), layer 3 global (linear rope
    scaling); a softmax scale of 24 ** -0.5 (not the head dim's); logits soft-capped."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        **FAMILY,
        sliding_window=WINDOW,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
        },
        query_pre_attn_scalar=24,
        final_logit_softcapping=30.0,
    )
    return Gemma3ForCausalLM(cfg)


def _gpt_oss():
    """Sliding (window 16) and full layers alternating, sinks, 8 experts (top 2), YaRN."""
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(**FAMILY, sliding_window=WINDOW, num_local_experts=8, num_experts_per_tok=2)
    return GptOssForCausalLM(cfg)


# the recurrent hybrids: 4 layers, a GQA attention layer (2 KV heads of 16 channels) among
# gated DeltaNet (2 key heads of 8, 4 value heads of 16: grouped) or Mamba2 layers (4 heads of
# 16, 2 groups, state 16, chunks of 16 tokens) and, in Nemotron-H, an MLP-only layer
HYBRID = dict(COMMON, num_key_value_heads=2, head_dim=16)
# weights of std 0.05 (not COMMON's 0.15): with 0.15 the delta rule's chunk solve amplified
# rounding so much that transformers' own bfloat16 logits were 3.4 off its float32 ones (0.05:
# 0.1 - 1.3) and float32 5e-4 off float64; the greedy outputs still vary
DELTANET = dict(HYBRID, initializer_range=0.05, linear_conv_kernel_dim=4)
DELTANET.update(linear_key_head_dim=8, linear_value_head_dim=16)
DELTANET.update(linear_num_key_heads=2, linear_num_value_heads=4)


def _spread_norms(model, std: float = 0.1) -> None:
    """Norm weights off their init (Qwen3-Next's (1 + w) zeros, the gated norms' ones), so the
    tests see each norm's weight applied."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * std)


def _hybrid(name: str, **fields):
    """transformers' ``{name}ForCausalLM`` of ``{name}Config(**fields)``, its norms spread."""
    import transformers

    config = getattr(transformers, f"{name}Config")(**fields)
    model = getattr(transformers, f"{name}ForCausalLM")(config)
    _spread_norms(model)
    return model


def _qwen3_next():
    """Layers: DeltaNet x 3, gated attention (rotary on 4 of 16 channels); MoE of 4 experts
    (top 2) with a gated shared expert, layer 1 a dense MLP."""
    moe = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4)
    return _hybrid("Qwen3Next", **DELTANET, **moe, num_experts_per_tok=2, mlp_only_layers=[1])


def _qwen3_5():
    """Qwen3.5 text: Qwen3-Next's layers with split input projections and dense MLPs."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**DELTANET))
    _spread_norms(model)
    return model


MAMBA_LAYERS = ["linear_attention", "mlp", "full_attention", "linear_attention"]


def _nemotron_h():
    """Layers: Mamba2, MLP (relu^2), attention (no rotary), Mamba2 (4 heads of 16, 2 groups,
    state 16, chunks of 16)."""
    mamba = dict(ssm_state_size=16, mamba_num_heads=4, mamba_head_dim=16, n_groups=2)
    return _hybrid("NemotronH", **HYBRID, **mamba, layers_block_type=MAMBA_LAYERS, chunk_size=16)


def _granite_hybrid():
    """Granite 4.0-H: Mamba2, attention (rotary), Mamba2 x 2 (4 heads of 32, 2 groups, state
    16, chunks of 16); MoE of 4 experts (top 2) plus the shared MLP; every multiplier != 1."""
    mamba = dict(mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=16)
    moe = dict(num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32)
    scales = dict(embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=2.0)
    return _hybrid(
        "GraniteMoeHybrid",
        **dict(HYBRID, intermediate_size=32),
        **mamba,
        **moe,
        **scales,
        layer_types=["linear_attention", "full_attention"] + ["linear_attention"] * 2,
        position_embedding_type="rope",
        attention_multiplier=0.2,
    )


BUILDERS = {
    "llama": _llama,
    "qwen2": _qwen2,
    "qwen2_kv2": _qwen2_kv2,
    "mistral": _mistral,
    "deepseek_v3": _deepseek_v3,
    "deepseek_v2": _deepseek_v2,
    "qwen3": _qwen3,
    "qwen3_moe": _qwen3_moe,
    "gemma3": _gemma3,
    "gpt_oss": _gpt_oss,
    "qwen3_next": _qwen3_next,
    "qwen3_5": _qwen3_5,
    "nemotron_h": _nemotron_h,
    "granite_hybrid": _granite_hybrid,
}

# kinds whose initialisation repeats one token (FACTS: Qwen3-MoE, Gemma 3) or leaves the parts
# under test trivial (zero expert biases, unit norms): every tensor re-drawn, normal(0, std);
# Gemma's norms (applied as 1 + w) and sinks get their own spread
# (stds picked by the variety of greedy outputs of a few prompts)
REDRAW = {"qwen3_moe": 0.15, "gemma3": 0.02, "gpt_oss": 0.06}
REDRAW_SPREAD = {"norm.weight": 0.3, "sinks": 1.0}


def _redraw(model, std: float) -> None:
    gemma = "gemma" in type(model).__name__.lower()
    with torch.no_grad():
        for name, p in model.named_parameters():
            spread = next((v for k, v in REDRAW_SPREAD.items() if name.endswith(k)), None)
            if name.endswith("norm.weight") and not gemma:
                continue  # ones: leave them (a norm's scale, not under test here)
            p.copy_(torch.randn_like(p) * (std if spread is None else spread))


@functools.cache
def checkpoint(kind: str) -> str:
    """Directory of the tiny ``kind`` checkpoint (built on first use)."""
    torch.manual_seed(1234)
    model = BUILDERS[kind]().eval()
    if kind in REDRAW:
        _redraw(model, REDRAW[kind])
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
    from backends.runtime.sampling_params import SamplingParams

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


def assert_greedy_continues(kind: str, runner, pool, pages, slot, prompt, last, n: int = 8):
    """Greedy decoding of ``n`` tokens from a prefilled hybrid sequence (its ``pages``, state
    ``slot`` and last prompt logits ``last``) equals transformers' continuation (which stops
    after an EOS)."""
    tokens = [int(last.argmax())]
    for _ in range(n - 1):
        pos = len(prompt) + len(tokens) - 1
        logits = runner.decode(pool, [tokens[-1]], [pos], [pages], [slot])
        tokens.append(int(logits[0].argmax()))
    want = hf_greedy(kind, prompt, n)
    assert tokens[: len(want)] == want and (len(want) == n or want[-1] == 2)


def assert_slots_join_and_leave(kind: str, runner) -> None:
    """Four prompts (5 to 131 tokens) of different lengths, at most 3 running and only 2 state
    slots: sequences wait for a slot, join a running batch and leave it; each output equals
    transformers' greedy continuation, and every page and slot is back at the end."""
    from backends.runtime.engine import LLMEngine
    from backends.runtime.sampling_params import SamplingParams

    lengths, budgets = [5, 131, 23, 70], [12, 7, 20, 9]
    prompts = [random_prompt(n, seed=10 + i) for i, n in enumerate(lengths)]
    pool = runner.make_pool(96, 8, num_slots=2)
    pool.shuffle_free_list(seed=2)
    engine = LLMEngine(runner, pool, max_batch=3)
    reqs = [(p, SamplingParams(max_tokens=m)) for p, m in zip(prompts, budgets, strict=True)]
    seqs = [engine.add_request(f"s{i}", p, sp) for i, (p, sp) in enumerate(reqs)]
    most = 0
    while engine.has_unfinished():
        engine.step()
        most = max(most, pool.states.slots_in_use)
        assert pool.states.slots_in_use == len(engine.running)  # one slot per running sequence
    assert most == 2
    for seq, prompt, m in zip(seqs, prompts, budgets, strict=True):
        assert seq.output_ids == hf_greedy(kind, prompt, m)
    assert len({t for s in seqs for t in s.output_ids}) > 8  # not one repeated token
    assert pool.num_free == 96 and pool.states.num_free == 2
