"""The attention families against transformers on tiny random checkpoints
(``runtime_models``: qwen3, qwen3_moe, gemma3, gpt_oss), colocated through the engine.

* float32: prefill logits (a prompt of 40 tokens, past the sliding window of 16), a prompt in
  three chunks and a decode step (each reading the pool through its layers' windows), and
  batched, continuous greedy decoding of prompts shorter and longer than the window, on the
  runtime's kernels (``auto``: the C++ CPU kernels) and on the torch path (``sdpa``);
* bfloat16 against transformers in bfloat16, equal up to a logit tie;
* tensor parallel size 2, speculative decoding with a draft of the same family, and what is
  refused at load.
"""

from __future__ import annotations

import functools
import json
import os

import pytest
import runtime_models as rm
import spec_models as sm
import torch

from backends.runtime.config import ModelConfig, UnsupportedArchitectureError
from backends.runtime.engine import LLMEngine
from backends.runtime.loader import load_runner
from backends.runtime.paged import SeqInput
from backends.runtime.sampling_params import SamplingParams
from backends.runtime.spec import load_draft, self_draft

KINDS = ["qwen3", "qwen3_moe", "gemma3", "gpt_oss"]
W = rm.WINDOW
WINDOWS = {
    "qwen3": [None] * 4,
    "qwen3_moe": [None] * 4,
    "gemma3": [W, W, W, None],
    "gpt_oss": [W, None, W, None],
}


@functools.cache
def runner_of(kind: str):
    """The float32 runner of ``kind`` (one per module run)."""
    return load_runner(rm.checkpoint(kind))


@pytest.mark.parametrize("kind", KINDS)
def test_config_parsed(kind):
    runner = runner_of(kind)
    cfg = runner.config
    assert [cfg.layer_window(i) for i in range(4)] == WINDOWS[kind]
    assert cfg.qk_norm == (kind != "gpt_oss") and cfg.attn_sinks == (kind == "gpt_oss")
    if kind == "gemma3":
        assert cfg.softmax_scale == 24**-0.5 and cfg.embedding_multiplier == 8.0
        assert cfg.final_logit_softcapping == 30.0 and cfg.hidden_act == "gelu_pytorch_tanh"
        assert (cfg.layer_rope(0).theta, cfg.layer_rope(0).type) == (10_000.0, "default")
        assert (cfg.layer_rope(3).theta, cfg.layer_rope(3).type) == (1_000_000.0, "linear")
        assert len(runner.model.ropes) == 2  # one table per rope, shared by its layers
    if kind == "qwen3_moe":
        assert cfg.moe_layers == (0, 2, 3) and cfg.norm_topk_prob
    if kind == "gpt_oss":
        assert cfg.rope.type == "yarn" and not cfg.rope.truncate and cfg.moe_layers == (0, 1, 2, 3)


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_logits_match_transformers(kind):
    rm.forward_vs_transformers(kind, runner_of(kind), n=40)


@pytest.mark.parametrize("kind", KINDS)
def test_chunks_and_decode_match_transformers(kind):
    """A prompt in chunks of 23, 7 and 9 tokens (the last two read the first chunk's pages
    through the window), then one decode step: every logit as transformers' whole-prompt one."""
    prompt = rm.random_prompt(40, seed=4)
    with torch.no_grad():
        ref = rm.hf_model(kind)(torch.tensor([prompt])).logits[0].float()  # [40, V]
    runner = runner_of(kind)
    pool = runner.make_pool(16, 4)
    pool.shuffle_free_list(seed=1)
    pages = pool.alloc(10)
    got = []
    for a, b in ((0, 23), (23, 30), (30, 39)):
        got += runner.forward(pool, [SeqInput(prompt[a:b], a, pages)])
    got.append(runner.decode(pool, [prompt[39]], [39], [pages]))
    rm.assert_close_to_reference(torch.cat(got), ref)


@pytest.mark.parametrize("attention", ["auto", "sdpa"])
@pytest.mark.parametrize("kind", KINDS)
def test_batched_greedy_matches_transformers(kind, attention, monkeypatch):
    """Three prompts (5, 21 and 37 tokens) through an engine of two slots: the third joins the
    batch when the first ends (continuous batching); each equals transformers' greedy."""
    runner = runner_of(kind)
    if attention != "auto":
        monkeypatch.setenv("PD_RUNTIME_ATTENTION", attention)
        runner = load_runner(rm.checkpoint(kind))
    prompts = [rm.random_prompt(n, seed=n) for n in (5, 21, 37)]
    steps = [12, 24, 20]
    engine = LLMEngine(runner, runner.make_pool(40, 4), max_batch=2)
    engine.pool.shuffle_free_list(seed=2)
    reqs = [(p, SamplingParams(max_tokens=n)) for p, n in zip(prompts, steps, strict=True)]
    seqs = engine.generate(reqs)
    for p, n, seq in zip(prompts, steps, seqs, strict=True):
        want = rm.hf_greedy(kind, p, n)
        assert seq.output_ids == want, (p, seq.output_ids, want)
    assert len({t for s in seqs for t in s.output_ids}) > 8  # not one token repeated
    assert engine.pool.num_free == 40


@pytest.mark.parametrize("kind", KINDS)
def test_bfloat16_greedy_matches_transformers_bfloat16(kind):
    from transformers import AutoModelForCausalLM

    path = rm.checkpoint(kind)
    runner = load_runner(path, dtype="bfloat16")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    prompts = [rm.random_prompt(n, seed=n) for n in (6, 27)]
    engine = LLMEngine(runner, runner.make_pool(32, 4), max_batch=2)
    seqs = engine.generate([(p, SamplingParams(max_tokens=20)) for p in prompts])
    equal = 0
    for prompt, seq in zip(prompts, seqs, strict=True):
        want = rm.greedy_generate(hf, prompt, 20)
        equal += rm.assert_greedy_matches_up_to_tie(hf, prompt, seq.output_ids, want, rm.BF16_TIE)
    assert equal >= 20  # at most one of the two parts, and not at once


@pytest.mark.parametrize("kind", ["qwen3", "gpt_oss"])
def test_tensor_parallel_2_matches_transformers(kind):
    """Qwen3: q/k norms replicated; gpt-oss: sinks sliced with the heads, the interleaved
    experts by intermediate column pairs, the down bias on rank 0 (Gemma 3 and Qwen3-MoE pass
    too, at about 9 s each: their shards are Qwen3's and DeepSeek's)."""
    tp2 = load_runner(rm.checkpoint(kind), tensor_parallel_size=2)
    try:
        assert tp2.model.layers[0].attn.H == 2
        rm.forward_vs_transformers(kind, tp2, n=30)
        rm.assert_greedy_generate_matches(kind, tp2, seed=3, n=24)
    finally:
        tp2.close()


@pytest.mark.parametrize("kind", ["gemma3", "gpt_oss"])
def test_speculative_decoding_with_drafts_of_the_family(kind):
    """A self-draft (the target's first layer) and a draft loaded from a checkpoint of the same
    family (here the target's own: every draft accepted) give the target-only greedy tokens."""
    runner = runner_of(kind)
    prompts = [rm.random_prompt(n, seed=n) for n in (3, 19)]
    drafts = [self_draft(runner, 1), load_draft(runner, rm.checkpoint(kind))]
    for draft in drafts:
        engine = sm.spec_engine(runner, draft, k=3)
        seqs = engine.generate([(p, sm.greedy(14)) for p in prompts])
        for p, s in zip(prompts, seqs, strict=True):
            assert s.output_ids == sm.reference(runner, p, sm.greedy(14))
        assert engine.stats.proposed > 0
        assert engine.pool.num_free == engine.pool.num_pages
    assert engine.stats.acceptance_rate == 1.0  # the full copy


def _config(kind: str) -> dict:
    with open(os.path.join(rm.checkpoint(kind), "config.json")) as f:
        return json.load(f)


@pytest.mark.parametrize(
    "kind, change, match",
    [
        ("gemma3", {"architectures": ["Gemma3ForConditionalGeneration"]}, "multimodal"),
        ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ("gemma3", {"use_bidirectional_attention": True}, "bidirectional"),
        ("gpt_oss", {"quantization_config": {"quant_method": "mxfp4"}}, "mxfp4"),
        ("qwen3", {"layer_types": ["linear_attention"] * 4}, "layer_types"),
        ("qwen3", {"hidden_act": "relu2"}, "hidden_act"),
    ],
)
def test_refuses_what_it_does_not_support(kind, change, match):
    with pytest.raises(UnsupportedArchitectureError, match=match):
        ModelConfig.from_dict({**_config(kind), **change})


def test_older_config_forms():
    """Gemma 3 configs before transformers 5 (rope_theta, rope_local_base_freq,
    sliding_window_pattern) and Qwen3's max_window_layers."""
    drop = ("layer_types", "rope_parameters")
    raw = {k: v for k, v in _config("gemma3").items() if k not in drop}
    raw.update(rope_theta=500_000.0, rope_local_base_freq=20_000.0, sliding_window_pattern=2)
    raw["rope_scaling"] = {"rope_type": "linear", "factor": 8.0}
    cfg = ModelConfig.from_dict(raw)
    assert [cfg.layer_window(i) for i in range(4)] == [W, None, W, None]
    assert (cfg.layer_rope(0).theta, cfg.layer_rope(0).type) == (20_000.0, "default")
    assert (cfg.layer_rope(1).theta, cfg.layer_rope(1).factor) == (500_000.0, 8.0)
    raw = {k: v for k, v in _config("qwen3").items() if k != "layer_types"}
    raw.update(use_sliding_window=True, sliding_window=8, max_window_layers=3)
    cfg = ModelConfig.from_dict(raw)
    assert [cfg.layer_window(i) for i in range(4)] == [None, None, None, 8]
    assert cfg.truncated(2).layer_types == ("full_attention",) * 2
