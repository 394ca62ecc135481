"""One bad request never fails the others of its batch; sampling is safe at any temperature."""

from __future__ import annotations

import pytest
import runtime_models as rm
import torch

from backends.runtime.engine import LLMEngine
from backends.runtime.sampler import generator, sample
from backends.runtime.sampling_params import SamplingParams
from backends.runtime.sequence import FinishReason
from backends.runtime.spec import DraftSpec, SpecEngine, self_draft

PROMPTS = [rm.random_prompt(n, seed=n) for n in (5, 9, 14)]


def test_extreme_temperatures_sample_without_errors():
    logits = torch.tensor([[1.0, 30.0, 2.0], [0.0, -5.0, 7.5]])  # 30 / 1e-38 overflows float32
    tiny = [SamplingParams(temperature=1e-38, seed=1), SamplingParams(temperature=1e-30, seed=2)]
    gens = [generator(p) for p in tiny]
    assert sample(logits, tiny, gens) == [1, 2]  # the greedy limit, not an inf/nan error
    huge = [SamplingParams(temperature=1e30, seed=s) for s in range(40)]
    got = {sample(logits[:1], [p], [generator(p)])[0] for p in huge}
    assert got == {0, 1, 2}  # the uniform limit


def _solo(llama, prompt, n=6):
    engine = LLMEngine(llama, llama.make_pool(32, 4))
    return engine.generate([(prompt, SamplingParams(max_tokens=n))])[0].output_ids


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "spec"])
def test_a_failing_sample_fails_that_sequence_only(llama, spec):
    pool = llama.make_pool(64, 4)
    if spec:
        draft = self_draft(llama, 2)
        engine = SpecEngine(llama, pool, DraftSpec(draft, draft.make_pool(64, 4, "draft"), 2))
    else:
        engine = LLMEngine(llama, pool)
    seqs = [
        engine.add_request(f"s{i}", p, SamplingParams(max_tokens=6)) for i, p in enumerate(PROMPTS)
    ]
    bad = engine.add_request("bad", PROMPTS[0], SamplingParams(max_tokens=6, temperature=0.7))
    engine.step()  # admission: every first token
    bad.generator = "not a generator"  # its next draw raises inside torch.multinomial
    errors = {}
    while engine.has_unfinished():
        errors.update(engine.step().errors)
    assert set(errors) == {"bad"} and "generator" in errors["bad"]  # its own error only
    assert bad.finish_reason == FinishReason.ERROR
    assert [s.output_ids for s in seqs] == [_solo(llama, p) for p in PROMPTS]
    assert pool.num_free == 64


def test_a_failing_batched_forward_is_retried_per_sequence(llama, monkeypatch):
    pool = llama.make_pool(64, 4)
    engine = LLMEngine(llama, pool)
    seqs = [
        engine.add_request(f"s{i}", p, SamplingParams(max_tokens=6)) for i, p in enumerate(PROMPTS)
    ]
    poison = engine.add_request("poison", [7, 7, 7], SamplingParams(max_tokens=6))
    engine.step()
    decode = llama.decode

    def failing(pool_, tokens, positions, tables):  # any batch holding the poison fails
        if poison.pages and tables and any(t is poison.pages for t in tables):
            raise RuntimeError("device assert in a kernel")
        return decode(pool_, tokens, positions, tables)

    monkeypatch.setattr(llama, "decode", failing)
    errors = {}
    while engine.has_unfinished():
        errors.update(engine.step().errors)
    assert set(errors) == {"poison"} and "device assert" in errors["poison"]
    monkeypatch.undo()
    assert [s.output_ids for s in seqs] == [_solo(llama, p) for p in PROMPTS]
    assert pool.num_free == 64
