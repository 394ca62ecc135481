"""Speculative decoding with penalties, stop strings, stop_token_ids and logprobs: the same
tokens, text, finish reasons and logprobs as the plain engine; sampling keeps the penalised
target distribution."""

from __future__ import annotations

import dataclasses

import pytest
import runtime_models as rm
import spec_models as sm
import torch
from fake_text import ByteTokenizer
from test_spec_sampling import CHI2_999, _chi2, _tv

from backends.runtime.engine import LLMEngine
from backends.runtime.sampler import penalize
from backends.runtime.sampling_params import SamplingParams
from backends.runtime.spec import DraftSpec, SpecEngine, probs, self_draft

TOL = 1e-4 if rm.DEVICE == "cpu" else 2e-3
PROMPTS = [rm.random_prompt(n, seed=200 + n) for n in (3, 8, 5, 11)]
PENALTIES = [
    dict(repetition_penalty=1.7),
    dict(frequency_penalty=1.1, presence_penalty=0.5),
    dict(presence_penalty=-0.8, repetition_penalty=0.8),
    {},
]


def _requests(llama, tok) -> list[tuple[list[int], SamplingParams]]:
    """Greedy requests with penalties; two get a stop string / stop token id that the plain
    engine's output reaches in its middle."""
    base = [SamplingParams(max_tokens=18, ignore_eos=True, logprobs=3, **pen) for pen in PENALTIES]
    plain = LLMEngine(llama, llama.make_pool(64, 4), max_batch=8, tokenizer=tok)
    outs = [s.output_ids for s in plain.generate(list(zip(PROMPTS, base, strict=True)))]
    text = tok.decode(outs[0])
    a = len(tok.decode(outs[0][:9])) - 1  # a stop string from token 8 into token 9..
    base[0] = dataclasses.replace(base[0], stop=(text[a : a + 3], "\x00unused"))
    base[1] = dataclasses.replace(base[1], stop_token_ids=(outs[1][11],))
    return list(zip(PROMPTS, base, strict=True))


def _run(engine, reqs):
    seqs = engine.generate(reqs, prefix="f")
    assert engine.pool.num_free == engine.pool.num_pages
    return seqs


@pytest.mark.parametrize("draft_kind", ["noisy", "self2", "full"])
def test_greedy_features_equal_plain_engine(llama, draft_kind):
    tok = ByteTokenizer()
    reqs = _requests(llama, tok)
    want = _run(LLMEngine(llama, llama.make_pool(64, 4), max_batch=8, tokenizer=tok), reqs)
    draft = {
        "noisy": lambda: sm.noisy_draft(llama, 0.3),
        "self2": lambda: self_draft(llama, 2),
        "full": lambda: self_draft(llama, llama.config.num_layers),
    }[draft_kind]()
    dspec = DraftSpec(draft, draft.make_pool(64, 4, role="draft"), num_spec_tokens=4)
    engine = SpecEngine(llama, llama.make_pool(64, 4), dspec, max_batch=8, tokenizer=tok)
    got = _run(engine, reqs)
    assert engine.draft.pool.num_free == engine.draft.pool.num_pages
    for w, g in zip(want, got, strict=True):
        assert g.output_ids == w.output_ids and g.finish_reason == w.finish_reason
        assert g.text.take(final=True) == w.text.take(final=True)
        assert len(g.logprobs) == len(g.output_ids)
        for a, b in zip(g.logprobs, w.logprobs, strict=True):
            assert a.token == b.token and abs(a.logprob - b.logprob) < TOL
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            torch.testing.assert_close(torch.tensor(a.top), torch.tensor(b.top), atol=TOL, rtol=0)
    assert [s.finish_reason for s in got] == ["stop", "stop", "length", "length"]
    assert got[0].text.stop_str is not None and len(got[0].output_ids) < 18
    if draft_kind == "full":  # the draft penalises its proposals exactly as the target
        assert engine.stats.acceptance_rate == 1.0
    else:
        assert 0 < engine.stats.acceptance_rate < 1


def test_penalties_change_speculative_output(llama):
    prompt = PROMPTS[1]
    p = SamplingParams(max_tokens=18, ignore_eos=True)
    pen = dataclasses.replace(p, frequency_penalty=1.1, presence_penalty=0.5)
    engine = sm.spec_engine(llama, sm.noisy_draft(llama, 0.3), k=3)
    a, b = engine.generate([(prompt, p), (prompt, pen)])
    assert a.output_ids == sm.reference(llama, prompt, p) != b.output_ids


def test_first_speculated_token_follows_penalised_target(llama):
    """As test_spec_sampling's engine test, with penalties that move the target's distribution:
    the emitted token follows the PENALISED target distribution, not the raw one."""
    n = 1200
    prompt, first = rm.random_prompt(6, seed=5), 7
    params = [
        SamplingParams(
            temperature=1.0, top_k=5, seed=i, max_tokens=3, ignore_eos=True,
            repetition_penalty=0.7, presence_penalty=-0.5,
        )
        for i in range(n)
    ]  # fmt: skip
    draft = sm.noisy_draft(llama, 0.5)
    engine = sm.spec_engine(llama, draft, k=2, pages=n, page_size=8, draft_page_size=8, max_batch=n)
    t_logits, d_logits = sm.add_same_prompt(engine, prompt, first, params)
    engine.step()  # admission: reports `first`
    out = engine.step()  # one speculative step (k clamped to 1)
    counts = torch.bincount(torch.tensor([t[0] for t in out.new_tokens.values()]), minlength=256)
    hist = [(prompt, [first])]
    p = probs(penalize(t_logits[-1:], params[:1], hist), params[0])[0]
    p_raw = probs(t_logits[-1:], params[0])[0]
    q = probs(penalize(d_logits[-1:], params[:1], hist), params[0])[0]
    assert _tv(p, p_raw) > 0.3 and _tv(p, q) > 0.2  # a wrong rule would show
    assert 0 < engine.stats.acceptance_rate < 1
    assert _chi2(counts.float(), p) < CHI2_999[4]
    assert _tv(counts.float() / counts.sum(), p_raw) > 0.2
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.num_free == n and engine.draft.pool.num_free == n


def test_seeded_sampling_with_penalties_is_reproducible(llama):
    def run(seed):
        engine = sm.spec_engine(llama, sm.noisy_draft(llama, 0.3), k=3)
        sp = SamplingParams(
            temperature=0.9, seed=seed, max_tokens=16, ignore_eos=True, repetition_penalty=1.5
        )
        return [s.output_ids for s in engine.generate([(p, sp) for p in PROMPTS[:2]])]

    assert run(1) == run(1) != run(2)
