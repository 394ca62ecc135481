"""The prefix cache over a KV pool, without a model: references, publish rules (owner only,
final KV only, never after quarantine), LRU eviction under pressure and at the cap, the events
it emits, exact page accounting, and the models it refuses."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import runtime_models as rm

from backends.runtime.config import ModelConfig
from backends.runtime.kv_pool import KVPool, OutOfPagesError
from backends.runtime.prefix_cache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    LeaseError,
    LeaseState,
    PrefixCache,
    block_hashes,
    check_prefix_cacheable,
    external,
    prefix_cache_refusal,
)
from backends.runtime.runner import ModelRunner

P = 4  # page size


def make(num_pages: int = 16, **kw) -> tuple[KVPool, PrefixCache, list]:
    from kvtransfer import EntryLayout

    layout = EntryLayout(
        role="target", attn="gqa", dtype="float32", page_size=P, num_layers=1,
        num_pages=num_pages, kv_heads=1, head_dim=2,
    )  # fmt: skip
    pool = KVPool(layout)
    events: list = []
    return pool, PrefixCache(pool, events=events.extend, **kw), events


def assert_accounting(pool: KVPool, cache: PrefixCache) -> None:
    """No references left; every page free, or cached and idle (held only by the cache)."""
    assert pool.pages_in_use == 0 and pool.num_free == pool.num_pages
    assert pool.num_idle == pool.num_cached == cache.num_cached
    assert all(pool.refcount(p) == 0 for p in range(pool.num_pages))


def toks(n: int, seed: int = 0) -> list[int]:
    return rm.random_prompt(n, seed=seed)


def test_hit_shares_pages_and_caps_at_len_minus_one():
    pool, cache, _ = make()
    prompt = toks(10)  # 2 full blocks + 2 tokens
    a = cache.acquire(prompt, 3)
    assert a.num_cached_tokens == 0 and len(a.pages) == 3
    assert a.commit(prompt, 10) == 2  # the partial third block is never cached
    assert [pool.is_cached(p) for p in a.pages] == [True, True, False]
    b = cache.acquire(prompt + [7], 3)
    assert b.num_cached_tokens == 8 and b.pages[:2] == a.pages[:2]
    assert all(pool.refcount(p) == 2 for p in a.pages[:2]) and b.pages[2] != a.pages[2]
    # a full hit keeps the last prompt token to compute: 8 tokens -> one block, not two
    c = cache.acquire(prompt[:8], 2)
    assert c.num_cached_tokens == 4
    assert cache.match(prompt[:8], max_cached_tokens=8).num_tokens == 8
    # off a page boundary: a prompt that diverges inside block 1 hits block 0 only
    d = cache.acquire(prompt[:6] + [1, 1, 1, 1], 3)
    assert d.num_cached_tokens == 4
    for lease in (a, b, c, d):
        lease.release()
    assert cache.stats.lookups == 4 and cache.stats.hit_tokens == 8 + 4 + 4
    assert cache.stats.lookup_tokens == 10 + 11 + 8 + 10
    assert_accounting(pool, cache)


def test_chain_hash_keys_whole_prefix():
    pool, cache, _ = make()
    x, y = toks(8, seed=1), toks(8, seed=2)
    a = cache.acquire(x, 2)
    a.commit(x, 8)
    # the same second block after another first block is another key
    b = cache.acquire(y[:4] + x[4:] + [5], 3)
    assert b.num_cached_tokens == 0
    assert block_hashes(x, P)[1] != block_hashes(y[:4] + x[4:], P)[1]
    for lease in (b, a):
        lease.release()
    assert_accounting(pool, cache)


def test_publish_rules_owner_final_quarantine_and_release_once():
    pool, cache, _ = make()
    prompt = toks(9)
    a = cache.acquire(prompt, 3)
    assert a.commit(prompt, 3) == 0  # KV of only 3 positions is final: no full block
    a.quarantine()
    assert a.state == LeaseState.QUARANTINED
    with pytest.raises(LeaseError):
        a.commit(prompt, 9)  # a page that may still be written is never published
    assert cache.num_cached == 0 and cache.match(prompt).num_tokens == 0
    a.release()
    with pytest.raises(LeaseError):
        a.release()  # exactly once
    with pytest.raises(LeaseError):
        a.commit(prompt, 9)
    page = pool.alloc(1)[0]
    with pytest.raises(ValueError, match="only cached pages"):
        pool.share([page])  # an owned page has one holder: its writer
    with pytest.raises(ValueError):
        cache.adopt([page, page])
    b = cache.acquire(prompt, 3)
    b.commit(prompt, 9)
    with pytest.raises(ValueError, match="cannot be cached"):
        pool.mark_cached(b.pages[0])  # already cached (read-only, maybe shared)
    c = cache.acquire(prompt, 3)  # shares b's two cached pages
    with pytest.raises(ValueError):
        cache.adopt(c.pages[:1])  # a shared page is no one's to adopt
    pool.free([page])
    b.release()
    c.release()
    assert_accounting(pool, cache)


def test_double_free_still_raises_with_refcounts():
    pool, cache, _ = make(num_pages=8)
    a = cache.acquire(prompt := toks(8), 2)
    a.commit(prompt, 8)
    b = cache.acquire(prompt + [3], 3)
    pages = a.pages
    a.release()
    pool.free(b.pages[:1])  # drops b's reference: the page is idle now
    with pytest.raises(ValueError, match="double free"):
        pool.free(b.pages[:1])
    with pytest.raises(ValueError, match="double free"):
        pool.free([pages[0], pages[0]])
    pool.free(b.pages[1:])
    with pytest.raises(ValueError, match="double free"):
        b.release()  # its references were dropped behind its back: caught, not corrupted
    assert_accounting(pool, cache)


def test_lru_eviction_under_pressure_never_evicts_referenced():
    pool, cache, events = make(num_pages=8)
    held = cache.acquire(p0 := toks(8, seed=10), 2)
    held.commit(p0, 8)  # 2 cached pages, referenced
    older = cache.acquire(p1 := toks(8, seed=11), 2)
    older.commit(p1, 8)
    older.release()  # 2 idle: p1's (released deepest block first)
    newer = cache.acquire(p2 := toks(8, seed=12), 2)
    newer.commit(p2, 8)
    newer.release()  # 2 more idle, more recently used
    assert pool.num_free == 6 and pool.num_idle == 4
    events.clear()
    fresh = pool.alloc(3)  # 2 free pages, then the LRU idle one: p1's deepest block
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert [e.block_hashes for e in removed] == [[external(block_hashes(p1, P)[1])]]
    assert cache.match(p1 + [0]).num_tokens == 4 and cache.match(p2 + [0]).num_tokens == 8
    with pytest.raises(OutOfPagesError):
        pool.alloc(4)  # 3 idle left; the 2 referenced pages are never evicted
    assert pool.num_idle == 3  # a failed allocation evicts nothing
    more = pool.alloc(3)
    assert cache.match(p0 + [0]).num_tokens == 8  # still there: referenced
    assert cache.stats.evicted_blocks == 4
    pool.free(fresh + more)
    held.release()
    assert_accounting(pool, cache)


def test_cap_bounds_cached_pages():
    pool, cache, _ = make(num_pages=16, max_pages=3)
    a = cache.acquire(pa := toks(12, seed=3), 3)
    assert a.commit(pa, 12) == 3
    b = cache.acquire(pb := toks(12, seed=4), 3)
    assert b.commit(pb, 12) == 0  # at the cap and every cached page referenced: nothing
    a.release()
    c = cache.acquire(pc := toks(12, seed=5), 3)
    assert c.commit(pc, 12) == 3  # evicts a's idle pages to stay at the cap
    assert cache.num_cached == 3 and cache.match(pa + [0]).num_tokens == 0
    b.release()
    c.release()
    assert_accounting(pool, cache)
    with pytest.raises(ValueError):
        PrefixCache(KVPool(pool.layout), max_pages=0)


def test_fits_and_acquire_all_or_nothing():
    pool, cache, _ = make(num_pages=6)
    a = cache.acquire(p := toks(8), 2)
    a.commit(p, 8)
    a.release()  # 2 idle
    assert cache.fits(p + [1], 6)  # 2 hits + 4 free
    assert not cache.fits(toks(8, seed=9), 7)
    other = pool.alloc(3)
    # the hits are idle: they count as free for others, but not twice for this request
    assert pool.num_free == 3 and not cache.fits(p + [1], 4)
    with pytest.raises(OutOfPagesError):
        cache.acquire(p + [1], 4)
    assert pool.num_idle == 2 and cache.stats.lookups == 1  # nothing held, nothing counted
    b = cache.acquire(p + [1], 3)
    assert b.num_cached_tokens == 8 and pool.num_free == 0
    b.release()
    pool.free(other)
    assert_accounting(pool, cache)


def test_events_chain_duplicates_and_clear():
    pool, cache, events = make()
    turn1 = toks(9, seed=20)
    a = cache.acquire(turn1, 3)
    a.commit(turn1, 9)
    h = block_hashes(turn1 + toks(7, seed=21), P)
    (stored,) = events
    assert isinstance(stored, BlockStored) and stored.parent_block_hash is None
    assert stored.block_hashes == [external(x) for x in h[:2]]
    assert stored.token_ids == turn1[:8] and stored.block_size == P and stored.group_idx == 0
    turn2 = turn1 + toks(7, seed=21)  # 16 tokens: blocks 2 and 3 are new
    b = cache.acquire(turn2, 4)
    assert b.num_cached_tokens == 8
    b.commit(turn2, 16)
    assert events[1].parent_block_hash == external(h[1])
    assert events[1].block_hashes == [external(x) for x in h[2:4]]
    assert events[1].token_ids == turn2[8:16]
    # a block computed twice (a hit missed by a concurrent request) is published once
    c = cache.adopt(pool.alloc(4))
    assert c.commit(turn2, 16) == 0 and len(events) == 2
    for lease in (a, b, c):
        lease.release()
    cache.clear()
    assert isinstance(events[-1], AllBlocksCleared) and cache.num_cached == 0
    assert pool.num_free == pool.num_pages and pool.num_cached == 0
    assert_accounting(pool, cache)


def test_clear_with_referenced_pages():
    pool, cache, _ = make()
    a = cache.acquire(p := toks(8), 2)
    a.commit(p, 8)
    cache.clear()
    assert cache.match(p + [1]).num_tokens == 0 and pool.pages_in_use == 2
    a.release()  # the last holder frees them
    assert_accounting(pool, cache)


def test_one_cache_per_pool_and_sink_errors_do_not_break_it():
    pool, cache, _ = make()
    with pytest.raises(ValueError):
        PrefixCache(pool)

    def broken(_events):
        raise RuntimeError("sink down")

    cache.events = broken
    a = cache.acquire(p := toks(8), 2)
    assert a.commit(p, 8) == 2 and cache.stats.event_errors == 1
    a.release()
    assert_accounting(pool, cache)


def test_refuses_models_that_cannot_be_cached_by_page():
    plain = ModelConfig.from_pretrained(rm.checkpoint("llama"))
    assert prefix_cache_refusal(plain) is None
    assert "sliding-window" in prefix_cache_refusal(replace(plain, sliding_window=16))
    kinds = ("full_attention", "sliding_attention") * 2
    mixed = replace(plain, layer_types=kinds, sliding_window=8)
    assert "sliding-window" in prefix_cache_refusal(mixed)
    full = replace(plain, layer_types=("full_attention",) * 4, sliding_window=8)
    assert prefix_cache_refusal(full) is None
    hybrid = ModelConfig.from_pretrained(rm.checkpoint("qwen3_next"))  # gated DeltaNet layers
    assert "recurrent" in prefix_cache_refusal(hybrid)
    with pytest.raises(ValueError, match="prefix_cache is not supported.*recurrent"):
        check_prefix_cacheable(hybrid)
    odd = SimpleNamespace(has_recurrent_state=False, layer_types=("conv",), sliding_window=None)
    assert "conv" in prefix_cache_refusal(odd)


def test_mistral_runner_refused():
    runner: ModelRunner
    from backends.runtime.engine import LLMEngine
    from backends.runtime.loader import load_runner

    runner = load_runner(rm.checkpoint("mistral"))
    pool = runner.make_pool(8, P)
    with pytest.raises(ValueError, match="sliding-window"):
        LLMEngine(runner, pool, prefix_cache=PrefixCache(pool))


def test_the_router_knows_whether_decode_keeps_a_cache():
    """``caches`` (the router's view, from parameters and configs) agrees with what a stage
    loads: off by parameter, for a recurrent or sliding-window model, and with an EAGLE head."""
    from eagle_heads import random_head

    from backends.stages.params import StageParams
    from backends.stages.prefix import caches

    llama = rm.checkpoint("llama")
    assert caches(StageParams(model_dir=llama))
    assert not caches(StageParams(model_dir=llama, prefix_cache="off"))
    assert not caches(StageParams(model_dir=rm.checkpoint("qwen3_next")))
    assert not caches(StageParams(model_dir=rm.checkpoint("mistral")))
    head = StageParams(model_dir=llama, spec_enabled=True, draft_model_dir=random_head(llama))
    assert not caches(head)
