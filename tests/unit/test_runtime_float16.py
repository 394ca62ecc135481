"""float16 models: the runtime in float16 against transformers in float16 (tiny models of every
family, and SmolLM2; SmolLM2 in bfloat16 too), greedy, equal up to a logit tie
(``runtime_models.HALF_TIE`` / ``BF16_TIE``). Under ``PD_TEST_DEVICE=cuda`` (scripts/gpu_check.sh)
the runtime side runs on the GPU, through the Triton attention kernel."""

from __future__ import annotations

import os

import pytest
import runtime_models as rm
import torch

from backends.runtime.dtypes import MODEL_DTYPES, model_dtype
from backends.runtime.engine import LLMEngine
from backends.runtime.loader import load_runner
from backends.runtime.sampling_params import SamplingParams

KINDS = ["llama", "qwen2", "mistral", "deepseek_v3", "deepseek_v2"]
MODEL = os.path.join(os.path.dirname(__file__), "..", "..", "models", "smollm2-135m-instruct")


def hf_half(path: str, dtype: str = "float16"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()


def test_float16_is_a_model_dtype():
    from backends.stages.params import StageParams
    from kvtransfer.memory.layout import DTYPE_SIZES

    assert "float16" in MODEL_DTYPES and model_dtype("float16") == torch.float16
    assert StageParams(dtype="float16").dtype == "float16"  # the stage parameter takes it
    assert DTYPE_SIZES["float16"] == 2  # and the KV layouts / handshake know its size
    with pytest.raises(ValueError, match="float16"):
        StageParams(dtype="float64")  # the message names the choices


@pytest.mark.parametrize("kind", KINDS)
def test_float16_greedy_matches_transformers_float16(kind):
    runner = load_runner(rm.checkpoint(kind), dtype="float16")
    pool = runner.make_pool(32, 8)
    assert pool.tensor.dtype == torch.float16 and pool.layout.dtype == "float16"
    hf = hf_half(rm.checkpoint(kind))
    engine = LLMEngine(runner, pool, max_batch=4)
    prompts = [rm.random_prompt(5 + 4 * seed, seed=seed) for seed in (0, 7)]
    seqs = engine.generate([(p, SamplingParams(max_tokens=24)) for p in prompts])
    equal = 0
    for prompt, seq in zip(prompts, seqs, strict=True):
        want = rm.greedy_generate(hf, prompt, 24)
        equal += rm.assert_greedy_matches_up_to_tie(hf, prompt, seq.output_ids, want)
    assert equal >= 24  # at most one of the two runs parts, and not at once


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_smollm2_half_greedy_matches_transformers_same_dtype(dtype):
    from backends.runtime.tokenizer import Tokenizer

    tok = Tokenizer(MODEL)
    runner = load_runner(MODEL, dtype=dtype)
    hf = hf_half(MODEL, dtype)
    pool = runner.make_pool(64, 16)
    pool.shuffle_free_list(seed=5)
    engine = LLMEngine(runner, pool, max_batch=4)
    texts = ["What is the capital of France?", "Write a haiku about the sea."]
    prompts = [tok.encode(t, chat=True) for t in texts]
    seqs = engine.generate([(p, SamplingParams(max_tokens=24)) for p in prompts])
    for prompt, seq in zip(prompts, seqs, strict=True):
        want = rm.greedy_generate(hf, prompt, len(seq.output_ids))
        tie = rm.HALF_TIE if dtype == "float16" else rm.BF16_TIE
        rm.assert_greedy_matches_up_to_tie(hf, prompt, seq.output_ids, want, tie)
    assert "Paris" in tok.decode(seqs[0].output_ids)
    assert pool.num_free == 64
