"""Continuous batching: batched decode equals solo decode; pages are returned exactly once."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import runtime_models as rm

from backends.runtime.engine import LLMEngine
from backends.runtime.loader import load_runner
from backends.runtime.sampling_params import SamplingParams
from backends.runtime.sequence import FinishReason


@pytest.fixture(scope="module", params=["qwen2", "deepseek_v3"])
def runner(request):
    return load_runner(rm.checkpoint(request.param))


def _solo(runner, prompt, max_tokens):
    engine = LLMEngine(runner, runner.make_pool(16, 4), max_batch=1)
    return engine.generate([(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))])[
        0
    ].output_ids


def test_batched_decode_equals_solo(runner):
    prompts = [rm.random_prompt(n, seed=n) for n in (1, 3, 5, 8, 13, 17, 22, 30, 9, 2)]
    max_tokens = [12, 20, 7, 16, 20, 3, 20, 11, 1, 20]
    pool = runner.make_pool(120, 4)
    pool.shuffle_free_list(seed=11)  # fragmented, non-monotonic page tables
    engine = LLMEngine(runner, pool, max_batch=16)
    seqs = engine.generate(
        [
            (p, SamplingParams(max_tokens=m, ignore_eos=True))
            for p, m in zip(prompts, max_tokens, strict=True)
        ]
    )
    assert max(len(s.pages) for s in seqs) == 0  # released
    assert pool.num_free == 120
    for p, m, s in zip(prompts, max_tokens, seqs, strict=True):
        assert s.output_ids == _solo(runner, p, m)
        assert len(s.output_ids) == m and s.finish_reason == FinishReason.LENGTH


def test_admission_waits_for_pages_and_batch_slots(runner):
    pool = runner.make_pool(10, 4)  # each request below needs 5 pages: two fit at once
    engine = LLMEngine(runner, pool, max_batch=8)
    for i in range(3):
        engine.add_request(f"r{i}", rm.random_prompt(10, seed=i), SamplingParams(max_tokens=10))
    out = engine.step()
    assert sorted(out.new_tokens) == ["r0", "r1"] and len(engine.waiting) == 1
    assert pool.num_free == 0
    finished = []
    while engine.has_unfinished():
        finished += [s.seq_id for s in engine.step().finished]
    assert sorted(finished) == ["r0", "r1", "r2"] and pool.num_free == 10


def test_every_token_reported_once(runner):
    engine = LLMEngine(runner, runner.make_pool(40, 4), max_batch=2)
    ids = {f"s{i}": rm.random_prompt(4 + i, seed=i) for i in range(4)}
    for sid, p in ids.items():
        engine.add_request(sid, p, SamplingParams(max_tokens=6))
    streamed: dict[str, list[int]] = {sid: [] for sid in ids}
    done = {}
    while engine.has_unfinished():
        out = engine.step()
        for sid, toks in out.new_tokens.items():
            assert len(toks) == 1
            streamed[sid] += toks
        done.update({s.seq_id: s.output_ids for s in out.finished})
    assert streamed == done and all(len(v) == 6 for v in done.values())


def test_abort_frees_pages(runner):
    pool = runner.make_pool(30, 4)
    engine = LLMEngine(runner, pool, max_batch=1)
    engine.add_request("a", rm.random_prompt(6, seed=1), SamplingParams(max_tokens=20))
    engine.add_request("b", rm.random_prompt(6, seed=2), SamplingParams(max_tokens=20))
    engine.step()
    assert pool.num_free < 30
    assert engine.abort("a").finish_reason == FinishReason.ABORT  # running
    assert engine.abort("b").finish_reason == FinishReason.ABORT  # still waiting
    assert engine.abort("a") is None  # already gone: no second free
    assert pool.num_free == 30 and not engine.has_unfinished()


def test_add_prefilled_continues_like_local_prefill(runner):
    prompt = rm.random_prompt(11, seed=9)
    expected = _solo(runner, prompt, 10)
    pool = runner.make_pool(40, 4)
    pool.shuffle_free_list(seed=2)
    pages = pool.alloc(pool.pages_needed(len(prompt)))
    logits = runner.prefill(pool, prompt, pages)  # stands in for KV received over the network
    first = int(logits.argmax())
    engine = LLMEngine(runner, pool, max_batch=4)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    seq = engine.add_prefilled("p", prompt, pages, first, params)
    out = engine.step()
    assert out.new_tokens == {"p": [first]}
    while engine.has_unfinished():
        engine.step()
    assert seq.output_ids == expected
    assert pool.num_free == 40  # the engine owned and freed the caller's prompt pages


def test_add_prefilled_single_token_finishes_on_admission(runner):
    pool = runner.make_pool(8, 4)
    pages = pool.alloc(2)
    engine = LLMEngine(runner, pool)
    engine.add_prefilled("p", [5, 6, 7, 8, 9], pages, 42, SamplingParams(max_tokens=1))
    out = engine.step()
    assert [s.output_ids for s in out.finished] == [[42]] and pool.num_free == 8


def test_stops_at_eos_unless_ignored(runner):
    prompt = rm.random_prompt(6, seed=3)
    full = _solo(runner, prompt, 16)
    eos = full[5]  # declare a token the model emits as EOS
    stop_runner = copy.copy(runner)
    stop_runner.config = dataclasses.replace(runner.config, eos_token_ids=(eos,))
    engine = LLMEngine(stop_runner, stop_runner.make_pool(16, 4))
    stopped, ignored = engine.generate(
        [
            (prompt, SamplingParams(max_tokens=16)),
            (prompt, SamplingParams(max_tokens=16, ignore_eos=True)),
        ]
    )
    assert stopped.output_ids == full[: full.index(eos) + 1]
    assert stopped.finish_reason == FinishReason.STOP
    assert ignored.output_ids == full and ignored.finish_reason == FinishReason.LENGTH
