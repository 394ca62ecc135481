"""The colocated engine with a prefix cache: greedy output equals the cache off (and
transformers) over many requests with shared prefixes (hits on and off page boundaries, full
hits, multi-turn chats, batches mixing hits and misses, eviction under a small pool,
cancellation, speculative decoding), cached pages are never written while shared, and page
accounting is exact at the end."""

from __future__ import annotations

import random

import pytest
import runtime_models as rm
import torch

from backends.runtime.engine import LLMEngine
from backends.runtime.loader import load_runner
from backends.runtime.prefix_cache import PrefixCache
from backends.runtime.sampling_params import SamplingParams
from backends.runtime.sequence import FinishReason
from backends.runtime.spec import DraftSpec, SpecEngine, load_draft

P = 4  # page size


@pytest.fixture(scope="module", params=["llama", "deepseek_v3"])
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def runner(kind):
    return load_runner(rm.checkpoint(kind))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def cached_engine(runner, pages: int, max_batch: int = 8, **cache_kw):
    pool = runner.make_pool(pages, P)
    pool.shuffle_free_list(seed=pages)  # fragmented page tables
    cache = PrefixCache(pool, **cache_kw)
    return LLMEngine(runner, pool, max_batch=max_batch, prefix_cache=cache), cache


def reference(runner, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Cache-off greedy outputs, one engine, batched."""
    engine = LLMEngine(runner, runner.make_pool(256, P), max_batch=16)
    return [s.output_ids for s in engine.generate([(p, greedy(n)) for p in prompts])]


def assert_accounting(engine: LLMEngine, cache: PrefixCache) -> None:
    pool = engine.pool
    assert not engine.seqs and not engine._leases
    assert pool.pages_in_use == 0 and pool.num_free == pool.num_pages
    assert pool.num_idle == pool.num_cached == cache.num_cached
    assert all(pool.refcount(p) == 0 for p in range(pool.num_pages))


def workload(seed: int = 0) -> list[list[int]]:
    """Prompts sharing prefixes: a system prompt off a page boundary (10 tokens) and one on it
    (8), users below them, repeats (full hits), prompts that fill their last page exactly,
    and unrelated ones."""
    r = random.Random(seed)
    sys_a, sys_b = rm.random_prompt(10, seed=100 + seed), rm.random_prompt(8, seed=200 + seed)
    out = []
    for i in range(6):
        user = rm.random_prompt(r.randint(1, 9), seed=300 + 10 * seed + i)
        out.append(sys_a + user)
        out.append(sys_b + user)
    out += [out[0], out[3], sys_a[:8], sys_b, sys_a + sys_b]  # full hits, exact pages
    out += [rm.random_prompt(r.randint(3, 14), seed=400 + i) for i in range(3)]
    return out


def run_batches(engine, prompts, n, batch):
    """Submit ``batch`` requests at a time (later ones hit what earlier ones published)."""
    outs = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        seqs = [engine.add_request(f"r{i + j}", p, greedy(n)) for j, p in enumerate(chunk)]
        while engine.has_unfinished():
            engine.step()
        outs += seqs
    return outs


def test_greedy_equals_cache_off_with_shared_prefixes(runner):
    prompts = workload()
    want = reference(runner, prompts, 6)
    engine, cache = cached_engine(runner, 200)
    seqs = run_batches(engine, prompts, 6, batch=5)  # batches mix hits and misses
    assert [s.output_ids for s in seqs] == want
    cached = [s.num_cached_tokens for s in seqs]
    assert all(c % P == 0 and c <= len(p) - 1 for c, p in zip(cached, prompts, strict=True))
    assert sum(c > 0 for c in cached) >= 12 and cache.stats.hit_tokens == sum(cached)
    # off a boundary (10-token system prompt: 8 cached), on it, and full hits (len - 1 cap)
    assert {8, 12} & set(cached)
    i = prompts.index(prompts[0], 1)  # a repeated prompt: everything cached but its last block
    assert cached[i] == (len(prompts[0]) - 1) // P * P
    assert_accounting(engine, cache)


def test_equals_transformers_on_hits(kind, runner):
    engine, cache = cached_engine(runner, 64)
    base = rm.random_prompt(13, seed=7)
    prompts = [base, base + [5, 9], base]
    seqs = run_batches(engine, prompts, 8, batch=1)
    assert [s.num_cached_tokens for s in seqs] == [0, 12, 12]
    for p, s in zip(prompts, seqs, strict=True):
        assert s.output_ids == rm.hf_greedy(kind, p, 8)
    assert_accounting(engine, cache)


def test_multi_turn_chat_hits_generated_blocks(runner):
    """Turn k+1 is turn k's prompt + its answer + a new user message: its hit covers the
    previous answer (published as decode generated it)."""
    engine, cache = cached_engine(runner, 64)
    ref_engine = LLMEngine(runner, runner.make_pool(64, P), max_batch=1)
    history = rm.random_prompt(9, seed=1)
    final = 0  # KV positions the previous turn made final: its prompt + all but its last token
    for turn in range(4):
        (seq,) = run_batches(engine, [history], 7, batch=1)
        (want,) = ref_engine.generate([(history, greedy(7))], prefix=f"t{turn}")
        assert seq.output_ids == want.output_ids
        assert seq.num_cached_tokens == min(final, len(history) - 1) // P * P
        final = seq.num_tokens - 1
        history = history + seq.output_ids + rm.random_prompt(3, seed=50 + turn)
    assert_accounting(engine, cache)


def test_eviction_under_a_small_pool(runner):
    prompts = workload(seed=1) * 2
    want = reference(runner, prompts, 5)
    # 4 running sequences take at most 24 pages: the cache must give pages back to go on
    engine, cache = cached_engine(runner, 34, max_batch=4)
    seqs = run_batches(engine, prompts, 5, batch=7)
    assert [s.output_ids for s in seqs] == want
    assert cache.stats.evicted_blocks > 0 and cache.stats.hit_tokens > 0
    assert_accounting(engine, cache)


def test_cap_on_cached_share(runner):
    engine, cache = cached_engine(runner, 100, max_pages=6)
    prompts = workload(seed=2)
    seqs = run_batches(engine, prompts, 4, batch=4)
    assert [s.output_ids for s in seqs] == reference(runner, prompts, 4)
    assert 0 < cache.num_cached <= 6
    assert_accounting(engine, cache)


def test_cancel_midway_releases_once_and_later_requests_still_match(runner):
    prompts = workload(seed=3)
    engine, cache = cached_engine(runner, 120, max_batch=4)
    for i, p in enumerate(prompts):
        engine.add_request(f"c{i}", p, greedy(8))
    engine.step()
    engine.step()
    aborted = [engine.abort(f"c{i}") for i in (0, 1, 6, 15)]  # running ones and waiting ones
    assert all(s is not None and s.finish_reason == FinishReason.ABORT for s in aborted)
    assert engine.abort("c0") is None  # released exactly once
    done = {}
    while engine.has_unfinished():
        done.update({s.seq_id: s.output_ids for s in engine.step().finished})
    want = reference(runner, prompts, 8)
    for i, w in enumerate(want):
        if f"c{i}" in done:
            assert done[f"c{i}"] == w
    again = run_batches(engine, prompts[:4], 8, batch=4)  # hits what the cancelled published
    assert [s.output_ids for s in again] == want[:4]
    assert all(s.num_cached_tokens > 0 for s in again)
    assert_accounting(engine, cache)


def test_shared_pages_are_never_written(runner):
    engine, cache = cached_engine(runner, 80, max_batch=8)
    system = rm.random_prompt(17, seed=9)
    run_batches(engine, [system + [3]], 2, batch=1)
    pages = list(cache.match(system).pages)
    assert len(pages) == 4  # 16 of the system prompt's 17 tokens
    kv = engine.pool.tensor
    page_dim = 2 if engine.pool.layout.attn == "gqa" else 1  # see EntryLayout.buffer_shape

    def checksums():
        return [kv.select(page_dim, p).double().sum().item() for p in pages] + [
            kv.select(page_dim, p).double().abs().sum().item() for p in pages
        ]

    before = checksums()
    prompts = [system + rm.random_prompt(1 + i % 6, seed=1000 + i) for i in range(100)]
    seqs = run_batches(engine, prompts, 3, batch=8)
    assert all(s.num_cached_tokens == 16 for s in seqs)
    assert checksums() == before
    assert_accounting(engine, cache)


def test_prefilled_sequences_publish_their_prompt(runner):
    engine, cache = cached_engine(runner, 40)
    prompt = rm.random_prompt(11, seed=4)
    (first,) = reference(runner, [prompt], 1)
    pages = engine.pool.alloc(engine.pool.pages_needed(len(prompt)))
    runner.prefill(engine.pool, prompt, pages)  # as if received from a prefill server
    engine.add_prefilled("p", prompt, pages, first[0], greedy(5))
    while engine.has_unfinished():
        engine.step()
    assert cache.match(prompt + [1]).num_tokens == 8
    (seq,) = run_batches(engine, [prompt], 5, batch=1)
    assert seq.num_cached_tokens == 8 and seq.output_ids == reference(runner, [prompt], 5)[0]
    assert_accounting(engine, cache)


@pytest.mark.parametrize("kind", ["llama"], indirect=True)  # one target is enough here
def test_speculative_engine_with_cache(runner):
    draft = load_draft(runner, num_layers=2)
    prompts = workload(seed=4)
    want = reference(runner, prompts, 6)
    pool = runner.make_pool(120, P)
    dspec = DraftSpec(draft, draft.make_pool(120, P, role="draft"), num_spec_tokens=3)
    cache = PrefixCache(pool)
    cached = SpecEngine(runner, pool, dspec, prefix_cache=cache)
    seqs = run_batches(cached, prompts, 6, batch=5)
    assert [s.output_ids for s in seqs] == want
    assert cache.stats.hit_tokens > 0 and cached.stats.accepted > 0
    assert_accounting(cached, cache)
    assert cached.draft.pool.pages_in_use == 0


def test_refusals(runner):
    from backends.runtime.spec_eagle import EagleSpecEngine

    assert EagleSpecEngine.prefix_cache_refusal  # an EAGLE head reads every prompt feature
    pool, other = runner.make_pool(8, P), runner.make_pool(8, P)
    with pytest.raises(ValueError, match="engine's own pool"):
        LLMEngine(runner, pool, prefix_cache=PrefixCache(other))
    torch.testing.assert_close(pool.tensor, torch.zeros_like(pool.tensor))  # untouched
