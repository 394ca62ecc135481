"""The real default model (SmolLM2-135M-Instruct): greedy output equals transformers generate."""

from __future__ import annotations

import os

import pytest
import runtime_models as rm
import torch

from backends.runtime.engine import LLMEngine
from backends.runtime.loader import load_runner
from backends.runtime.sampling_params import SamplingParams
from backends.runtime.tokenizer import Tokenizer

MODEL = os.path.join(os.path.dirname(__file__), "..", "..", "models", "smollm2-135m-instruct")
PROMPTS = [
    ("What is the capital of France?", True),
    ("Write a haiku about the sea.", True),
    ("The three primary colors are", False),
]

pytestmark = pytest.mark.slow  # needs the default model (scripts/setup.sh converts it)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(MODEL)


@pytest.fixture(scope="module")
def runner():
    return load_runner(MODEL)


@pytest.fixture(scope="module")
def hf_outputs(tok):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for text, chat in PROMPTS:
            ids = tok.encode(text, chat=chat)
            gen = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=32,
                do_sample=False,
            )
            outs.append(gen[0, len(ids) :].tolist())
    return outs


def test_prefill_logits_match_transformers(tok, runner):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    ids = tok.encode(PROMPTS[0][0], chat=True)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0, -1].float()
    pool = runner.make_pool(8, 16)
    logits = runner.prefill(
        pool, ids, pool.alloc(pool.pages_needed(len(ids))), groups=[(0, 10), (10, 20), (20, 30)]
    )
    rm.assert_close_to_reference(logits, ref)


def test_batched_greedy_matches_transformers(tok, runner, hf_outputs):
    pool = runner.make_pool(64, 16)
    pool.shuffle_free_list(seed=5)
    engine = LLMEngine(runner, pool, max_batch=8)
    reqs = [(tok.encode(t, chat=c), SamplingParams(max_tokens=32)) for t, c in PROMPTS]
    seqs = engine.generate(reqs)
    assert [s.output_ids for s in seqs] == hf_outputs
    assert pool.num_free == 64
    answer = tok.decode(seqs[0].output_ids)
    assert "Paris" in answer
    assert seqs[0].output_ids[-1] in runner.config.eos_token_ids  # chat answer ends with EOS


def test_text_deltas_of_generated_tokens_concatenate_to_the_full_text(tok, hf_outputs):
    """Decode's incremental text, one token at a time, rebuilds every answer."""
    from backends.runtime.detok import TextState

    for ids in hf_outputs:
        state, pieces = TextState(tok), []
        for i in range(len(ids)):
            state.update(ids[: i + 1])
            pieces.append(state.take())
        assert "".join(pieces) + state.take(final=True) == tok.decode(ids)
