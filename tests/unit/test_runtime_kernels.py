"""Kernel choices: packed linear layers equal F.linear; the settings turn them off; batched
prefill (several prompts in one forward, chunked by a token budget) equals one-by-one."""

from __future__ import annotations

import pytest
import runtime_models as rm
import torch
import torch.nn.functional as F

from backends.runtime.cpu_kernels import paged_decode_op
from backends.runtime.engine import LLMEngine
from backends.runtime.kernels import KernelSettings, Linear, pack_for_onednn
from backends.runtime.runner import ModelRunner
from backends.runtime.sampler import SamplingParams


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(48, 40, generator=g)
    b = torch.randn(48, generator=g) if bias else None
    x = torch.randn(rows, 40, generator=g)
    lin = Linear(w, b, KernelSettings())
    torch.testing.assert_close(lin(x), F.linear(x, w, b), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lin(x.t().contiguous().t()), F.linear(x, w, b))  # strided input


def test_linear_setting_and_fallbacks():
    w = torch.randn(16, 8)
    assert Linear(w, None, KernelSettings(linear="torch")).packed is None
    bf16 = Linear(w.bfloat16(), None, KernelSettings())  # packs float32 weights only
    assert bf16.packed is None and bf16(torch.ones(2, 8, dtype=torch.bfloat16)).shape == (2, 16)
    if torch.backends.mkldnn.is_available():
        assert pack_for_onednn(w) is not None
    with pytest.raises(ValueError, match="PD_RUNTIME_LINEAR"):
        KernelSettings(linear="fast")


def test_settings_from_env(monkeypatch):
    monkeypatch.setenv("PD_RUNTIME_LINEAR", "torch")
    assert KernelSettings.from_env() == KernelSettings(linear="torch")
    monkeypatch.delenv("PD_RUNTIME_LINEAR")
    assert KernelSettings.from_env() == KernelSettings()


def test_model_with_torch_linear_gives_the_same_tokens(monkeypatch):
    prompts = [rm.random_prompt(n, seed=n) for n in (3, 9, 14)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = []
    for choice in ("auto", "torch"):
        monkeypatch.setenv("PD_RUNTIME_LINEAR", choice)
        runner = ModelRunner.load(rm.checkpoint("llama"))
        engine = LLMEngine(runner, runner.make_pool(40, 4), max_batch=4)
        outs.append([s.output_ids for s in engine.generate([(p, params) for p in prompts])])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("kind", ["llama", "mistral", "deepseek_v2"])
def test_cpu_decode_kernel_gives_the_tokens_of_sdpa(monkeypatch, kind):
    """The default C++ decode attention against gather + SDPA through whole generations: GQA,
    a sliding window (mistral) and MLA's latent (deepseek_v2), mixed lengths in one batch."""
    prompts = [rm.random_prompt(n, seed=n) for n in (3, 9, 14, 30)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    outs = []
    for choice in ("auto", "sdpa"):
        monkeypatch.setenv("PD_RUNTIME_ATTENTION", choice)
        runner = ModelRunner.load(rm.checkpoint(kind))
        engine = LLMEngine(runner, runner.make_pool(64, 4), max_batch=4)
        outs.append([s.output_ids for s in engine.generate([(p, params) for p in prompts])])
    assert paged_decode_op() is not None
    assert outs[0] == outs[1]


def test_attention_setting():
    assert KernelSettings().attention == "auto"
    with pytest.raises(ValueError, match="PD_RUNTIME_ATTENTION"):
        KernelSettings(attention="flash")


@pytest.mark.parametrize("budget", [1, 20, 4096])
def test_batched_prefill_equals_one_by_one(llama, budget):
    prompts = [rm.random_prompt(n, seed=n) for n in (7, 2, 16, 11, 5)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    solo = []
    for p in prompts:
        engine = LLMEngine(llama, llama.make_pool(8, 4), max_batch=1)
        solo.append(engine.generate([(p, params)])[0].output_ids)
    pool = llama.make_pool(40, 4)
    pool.shuffle_free_list(seed=5)
    engine = LLMEngine(llama, pool, max_batch=8, prefill_tokens=budget)
    seqs = engine.generate([(p, params) for p in prompts])
    assert [s.output_ids for s in seqs] == solo and pool.num_free == 40


def test_prefill_chunks_follow_the_token_budget(llama):
    engine = LLMEngine(llama, llama.make_pool(40, 4), prefill_tokens=20)
    params = SamplingParams(max_tokens=2)
    seqs = [engine.add_request(f"c{n}", [5] * n, params) for n in (7, 2, 16, 11, 5, 30)]
    chunks = engine._prefill_chunks(seqs)
    assert [[len(s.prompt_ids) for s in c] for c in chunks] == [[7, 2], [16], [11, 5], [30]]


def test_prefill_tokens_must_be_positive(llama):
    with pytest.raises(ValueError, match="prefill_tokens"):
        LLMEngine(llama, llama.make_pool(4, 4), prefill_tokens=0)
