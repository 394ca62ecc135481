"""SmolLM2-135M (9 heads, 3 KV heads) split over 3 ranks equals the one-rank runtime, whose output
tests/unit/test_runtime_smollm2.py checks against transformers; 2 ranks are refused (9 heads)."""

from __future__ import annotations

import os

import pytest
import runtime_models as rm

from backends.runtime.engine import LLMEngine
from backends.runtime.loader import load_runner
from backends.runtime.runner import ModelRunner
from backends.runtime.sampling_params import SamplingParams
from backends.runtime.tokenizer import Tokenizer
from backends.runtime.tp.shard import TensorParallelConfigError

MODEL = os.path.join(os.path.dirname(__file__), "..", "..", "models", "smollm2-135m-instruct")

pytestmark = pytest.mark.slow  # needs the default model (scripts/setup.sh converts it)


def generate(runner: ModelRunner, prompt: list[int], n: int) -> tuple[list[int], object]:
    pool = runner.make_pool(8, 16)
    engine = LLMEngine(runner, pool, max_batch=2)
    (seq,) = engine.generate([(prompt, SamplingParams(max_tokens=n, ignore_eos=True))])
    logits = runner.prefill(pool, prompt, pool.alloc(pool.pages_needed(len(prompt))))
    return seq.output_ids, logits


def test_three_ranks_equal_one_rank():
    prompt = Tokenizer(MODEL).encode("What is the capital of France?", chat=True)
    one = load_runner(MODEL, device="cpu")
    want, want_logits = generate(one, prompt, 16)
    del one
    three = load_runner(MODEL, device="cpu", tensor_parallel_size=3)
    try:
        assert three.plan.kv_heads == (0, 1) and len(three.worker_pids) == 2
        got, got_logits = generate(three, prompt, 16)
    finally:
        three.close()
    assert got == want
    rm.assert_close_to_reference(got_logits, want_logits)


def test_two_ranks_are_refused_naming_the_heads():
    with pytest.raises(TensorParallelConfigError) as e:
        load_runner(MODEL, tensor_parallel_size=2)
    msg = str(e.value)
    assert "tensor_parallel_size 2 does not divide num_attention_heads 9" in msg
    assert "sizes that work: [1, 3, 9]" in msg
