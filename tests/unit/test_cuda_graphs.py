"""Decode steps from CUDA graphs (``backends/runtime/cuda_graphs.py``) on a GPU: greedy output
with graphs equals the eager runtime's and transformers', over bucket changes (sequences
finishing at different steps). Skipped without CUDA; scripts/gpu_check.sh runs it. On CPU,
tests/unit/test_triton_attn.py checks the same plumbing with a stand-in for the graphs."""

from __future__ import annotations

import pytest
import runtime_models as rm
import torch

from backends.runtime.engine import LLMEngine
from backends.runtime.loader import load_runner
from backends.runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def generate(runner, prompts, steps, graphs: bool):
    runner.use_graphs = graphs
    pool = runner.make_pool(64, 4)
    pool.shuffle_free_list(seed=4)
    engine = LLMEngine(runner, pool, max_batch=8)
    reqs = [(p, SamplingParams(max_tokens=n)) for p, n in zip(prompts, steps, strict=True)]
    out = [s.output_ids for s in engine.generate(reqs)]
    return out, runner._graphs.get(id(pool))


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_graphs_greedy_equals_eager_and_transformers(kind):
    runner = load_runner(rm.checkpoint(kind), device="cuda")
    prompts = [rm.random_prompt(n, seed=n) for n in (5, 19, 9, 30, 2)]
    steps = (12, 3, 12, 7, 12)
    eager, _ = generate(runner, prompts, steps, graphs=False)
    graphed, graphs = generate(runner, prompts, steps, graphs=True)
    assert graphs is not None and not graphs.failed and len(graphs.graphs) >= 2
    assert graphed == eager
    assert graphed == [rm.hf_greedy(kind, p, n) for p, n in zip(prompts, steps, strict=True)]


def test_graphs_by_default_for_gqa_models_with_the_triton_attention(monkeypatch):
    """On by default for GQA models; DeepSeek's MoE counts tokens per expert on the host (not
    capturable), so MLA/MoE models stay eager, and so do gather + SDPA (which the graphs' step
    buffers do not serve) and PD_RUNTIME_CUDA_GRAPHS=0."""
    monkeypatch.delenv("PD_RUNTIME_CUDA_GRAPHS", raising=False)
    monkeypatch.delenv("PD_RUNTIME_ATTENTION", raising=False)
    assert load_runner(rm.checkpoint("llama"), device="cuda").use_graphs
    assert not load_runner(rm.checkpoint("deepseek_v3"), device="cuda").use_graphs
    monkeypatch.setenv("PD_RUNTIME_ATTENTION", "sdpa")
    assert not load_runner(rm.checkpoint("llama"), device="cuda").use_graphs
    monkeypatch.setenv("PD_RUNTIME_ATTENTION", "auto")
    monkeypatch.setenv("PD_RUNTIME_CUDA_GRAPHS", "0")
    assert not load_runner(rm.checkpoint("llama"), device="cuda").use_graphs

