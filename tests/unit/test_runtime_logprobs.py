"""Logprobs: log_softmax of the raw model logits (before penalties / temperature), top-N best
first, one per output token, aligned with StepOutput.new_tokens."""

from __future__ import annotations

import pytest
import runtime_models as rm
import torch

from backends.runtime.engine import LLMEngine
from backends.runtime.paged import SeqInput
from backends.runtime.sampler import token_logprobs
from backends.runtime.sampling_params import SamplingParams, TokenLogprob

TOL = 1e-4 if rm.DEVICE == "cpu" else 2e-3


def test_token_logprobs_batched_rows():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 30, generator=g) * 4
    params = [SamplingParams(logprobs=3), SamplingParams(), SamplingParams(logprobs=0)]
    params.append(SamplingParams(logprobs=20))
    tokens = [5, 6, 7, 8]
    got = token_logprobs(logits, tokens, params)
    ref = torch.log_softmax(logits.double(), -1)
    assert got[1] is None
    for i in (0, 2, 3):
        lp = got[i]
        assert lp.token == tokens[i]
        assert abs(lp.logprob - float(ref[i, tokens[i]])) < 1e-5
        n = params[i].logprobs
        assert len(lp.top) == n
        want = torch.topk(ref[i], n) if n else None
        if n:
            assert [t for t, _ in lp.top] == want.indices.tolist()
            assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
            torch.testing.assert_close(
                torch.tensor([v for _, v in lp.top], dtype=torch.float64), want.values
            )
    assert token_logprobs(logits, [None] * 4, params) == [None] * 4


def _hf_rows(prompt: list[int], output: list[int]) -> torch.Tensor:
    """transformers logits at every output position: [len(output), V]."""
    with torch.no_grad():
        lg = rm.hf_model("llama")(torch.tensor([prompt + output])).logits[0].float()
    return lg[len(prompt) - 1 : len(prompt) + len(output) - 1]


def test_engine_logprobs_equal_log_softmax_of_model_logits(llama):
    prompts = [rm.random_prompt(n, seed=70 + n) for n in (4, 7, 5)]
    params = [
        SamplingParams(max_tokens=10, ignore_eos=True, logprobs=5),
        SamplingParams(
            max_tokens=9, ignore_eos=True, logprobs=2, temperature=0.7, seed=3,
            repetition_penalty=2.0, presence_penalty=1.0,
        ),
        SamplingParams(max_tokens=8, ignore_eos=True),  # did not ask
    ]  # fmt: skip
    engine = LLMEngine(llama, llama.make_pool(64, 4), max_batch=4)
    seqs = [engine.add_request(f"r{i}", p, params[i]) for i, p in enumerate(prompts)]
    streamed: dict[str, list[TokenLogprob]] = {}
    while engine.has_unfinished():
        out = engine.step()
        for sid, lps in out.logprobs.items():
            assert [lp.token for lp in lps] == out.new_tokens[sid]  # aligned
            streamed.setdefault(sid, []).extend(lps)
    assert "r2" not in streamed and seqs[2].logprobs == []
    for s in seqs[:2]:
        assert streamed[s.seq_id] == s.logprobs and len(s.logprobs) == len(s.output_ids)
        ref = torch.log_softmax(_hf_rows(s.prompt_ids, s.output_ids), -1)  # raw: no penalties
        n = s.params.logprobs
        for j, (tok, lp) in enumerate(zip(s.output_ids, s.logprobs, strict=True)):
            assert lp.token == tok
            assert abs(lp.logprob - float(ref[j, tok])) < TOL
            top = torch.topk(ref[j], n)
            assert [t for t, _ in lp.top] == top.indices.tolist()
            torch.testing.assert_close(
                torch.tensor([v for _, v in lp.top]), top.values, atol=TOL, rtol=0
            )
            assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:], strict=False))  # best first
        if s.params.greedy:  # the chosen token is the best one
            assert all(lp.top[0] == (lp.token, lp.logprob) for lp in s.logprobs)
    assert engine.pool.num_free == 64


def test_add_prefilled_reports_the_prefill_sides_first_logprob(llama):
    prompt = rm.random_prompt(6, seed=2)
    engine = LLMEngine(llama, llama.make_pool(16, 4), max_batch=2)
    params = SamplingParams(max_tokens=3, ignore_eos=True, logprobs=1)
    pages = engine.pool.alloc(2)
    [logits] = llama.forward(engine.pool, [SeqInput(prompt, 0, pages)], last_only=True)
    first = int(logits[-1].argmax())
    [lp] = token_logprobs(logits[-1:], [first], [params])
    with pytest.raises(ValueError, match="first_logprob"):
        engine.add_prefilled("x", prompt, pages, first, params)
    seq = engine.add_prefilled("a", prompt, pages, first, params, first_logprob=lp)
    out = engine.step()
    assert out.new_tokens["a"] == [first] and out.logprobs["a"] == [lp]
    while engine.has_unfinished():
        engine.step()
    assert seq.logprobs[0] == lp and len(seq.logprobs) == 3
    assert [x.token for x in seq.logprobs] == seq.output_ids
