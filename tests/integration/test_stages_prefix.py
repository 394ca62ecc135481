"""Prefix caching across PD (stage cores, PrefillWorker in its own process, real Mooncake): a
multi-turn chat's later turns hit both caches. Prefill computes only what its cache lacks,
decode registers pages only for what its cache lacks and prefill sends only those blocks (a
full hit moves no KV byte); greedy output equals transformers' token for token; decode never
writes into a cached page; every page comes back."""

from __future__ import annotations

import hashlib
import socket
import time

import pytest
from runtime_models import checkpoint, hf_greedy, random_prompt
from stagepeer import Collector, PrefillProcess, tiny_params

from backends.runtime.sampling_params import SamplingParams
from backends.stages.decode import DecodeWorker
from backends.stages.params import StageParams
from backends.stages.request import StageRequest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]
KIND, NEW, PAGE = "llama", 8, 4


def ask(prefill, decode, room: int, ids: list[int], max_tokens: int = NEW) -> list[int]:
    c = Collector()
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    req = StageRequest(
        room=room, prompt_ids=ids, sampling=sp, bootstrap_addr=prefill.addr, stream=True
    )
    decode.submit(req, c)
    results, _ = prefill.submit_all([(room, ids)])
    assert results[0][1] is None
    assert c.done.wait(60) and c.events[-1].error is None
    return c.ids


def kv_bytes_per_block(decode) -> int:
    lay = decode.pool.layout
    return lay.num_layers * lay.components * lay.page_bytes


def all_back(prefill, decode) -> bool:
    deadline = time.time() + 15
    while time.time() < deadline and (decode.pages_in_use or prefill.pages_in_use()):
        time.sleep(0.1)
    return decode.pages_in_use == 0 and prefill.pages_in_use() == 0


@pytest.fixture(scope="module")
def stages():
    ckpt = checkpoint(KIND)
    prefill = PrefillProcess(**tiny_params(ckpt, num_pages=128))
    decode = DecodeWorker(StageParams(**tiny_params(ckpt, num_pages=128)))
    yield prefill, decode
    decode.close()
    prefill.stop()


def test_a_chat_s_later_turns_move_only_their_new_blocks(stages):
    prefill, decode = stages
    block = kv_bytes_per_block(decode)
    system = random_prompt(22, seed=1)  # a shared system prompt, not page-aligned
    history, room = list(system), 1000
    for turn in range(4):
        history += random_prompt(5 + turn, seed=10 + turn)  # the user's turn
        sent0, hits0 = prefill.stats()["bytes"], decode.stats()["prefix_cached_tokens"]
        out = ask(prefill, decode, room, history)
        assert out == hf_greedy(KIND, history, NEW)
        sent = prefill.stats()["bytes"] - sent0
        hit = decode.stats()["prefix_cached_tokens"] - hits0
        blocks = -(-len(history) // PAGE)
        assert hit % PAGE == 0 and sent == (blocks - hit // PAGE) * block
        if turn:  # the earlier turns (prompt and answer) are cached on both sides
            assert hit >= len(history) - len(out) - 10 - PAGE
        history += out
        room += 1
    assert prefill.stats()["prefix_cached_tokens"] > 0  # prefill computed only suffixes
    assert all_back(prefill, decode)


def test_a_full_hit_moves_no_kv_byte_and_greedy_is_unchanged(stages):
    prefill, decode = stages
    ids = random_prompt(6 * PAGE, seed=5)  # page-aligned: every block can be cached
    first = ask(prefill, decode, 2000, ids)
    sent0 = prefill.stats()["bytes"]
    again = ask(prefill, decode, 2001, ids)
    assert again == first == hf_greedy(KIND, ids, NEW)
    assert prefill.stats()["bytes"] == sent0  # the first token travelled, no KV byte
    assert all_back(prefill, decode)


def test_decode_never_writes_into_a_cached_page(stages):
    prefill, decode = stages
    shared = random_prompt(5 * PAGE, seed=7)
    ask(prefill, decode, 3000, shared + [9])
    pages = decode.cache.match(shared, len(shared)).pages
    assert len(pages) == 5

    def digest() -> str:
        t = decode.pool.tensor
        return hashlib.sha256(b"".join(t[:, :, p].numpy().tobytes() for p in pages)).hexdigest()

    before = digest()
    for i in range(30):  # requests that hit the shared pages, with tails of their own
        ask(prefill, decode, 3001 + i, shared + random_prompt(1 + i % 5, seed=100 + i), 3)
    assert decode.cache.match(shared, len(shared)).pages == pages and digest() == before
    assert all_back(prefill, decode)


def test_cache_on_equals_cache_off(stages):
    prefill, decode = stages
    ckpt = checkpoint(KIND)
    off = tiny_params(ckpt, num_pages=128, prefix_cache="off")
    prefill_off, decode_off = PrefillProcess(**off), DecodeWorker(StageParams(**off))
    try:
        base = random_prompt(13, seed=3)
        for i in range(6):  # hits at page boundaries and off them
            ids = base + random_prompt(i, seed=50 + i) if i else base
            assert ask(prefill, decode, 4000 + i, ids) == ask(
                prefill_off, decode_off, 4000 + i, ids
            )
        assert decode_off.cache is None and "prefix_cached_tokens" not in decode_off.stats()
    finally:
        decode_off.close()
        prefill_off.stop()


def test_a_failed_room_s_pages_are_never_served_from_the_cache():
    """Prefill's writes into decode's pages fail: the room ends Failed and its pages wait in
    quarantine, never published; the same prompt later misses decode's cache and is right."""
    ckpt = checkpoint(KIND)
    params = tiny_params(ckpt, num_pages=64, transfer_timeout_s=20.0)
    bad, decode = PrefillProcess(fail_role="target", **params), DecodeWorker(StageParams(**params))
    good = PrefillProcess(**params)
    try:
        ids = random_prompt(5 * PAGE, seed=11)
        c = Collector()
        sp = SamplingParams(max_tokens=NEW, ignore_eos=True)
        req = StageRequest(room=5000, prompt_ids=ids, sampling=sp, bootstrap_addr=bad.addr)
        decode.submit(req, c)
        bad.submit_all([(5000, ids)])
        assert c.done.wait(60) and c.events[-1].error
        assert decode.cache.match(ids, len(ids)).num_tokens == 0
        assert ask(good, decode, 5001, ids) == hf_greedy(KIND, ids, NEW)
        assert decode.stats()["prefix_cached_tokens"] == 0  # 5001 hit nothing of 5000's pages
        assert all_back(good, decode)
    finally:
        decode.close()
        bad.stop()
        good.stop()


def test_decode_publishes_kv_events_of_what_it_caches():
    """kv_events_endpoint: a ZMQ SUB sees vLLM-format BlockStored events for a request's
    blocks, chained, with the blocks' token ids."""
    import zmq

    from backends.runtime.prefix_cache import BlockStored, decode_batch

    ckpt = checkpoint(KIND)
    with zmq.Context() as ctx:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        with socket.socket() as s:  # a free port for the stage to listen on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        events = dict(kv_events_endpoint=f"tcp://127.0.0.1:{port}", kv_events_topic="kv")
        params = tiny_params(ckpt, num_pages=64)
        prefill = PrefillProcess(**params)
        decode = DecodeWorker(StageParams(**params, **events))
        sub.connect(f"tcp://127.0.0.1:{port}")
        time.sleep(0.5)  # the subscription reaches the stage's PUB socket
        try:
            ids = random_prompt(3 * PAGE + 1, seed=21)
            ask(prefill, decode, 6000, ids)
            stored = []
            deadline = time.time() + 10
            while time.time() < deadline and sum(len(e.block_hashes) for e in stored) < 3:
                if sub.poll(200):
                    topic, seq, payload = sub.recv_multipart()
                    assert topic == b"kv" and len(seq) == 8
                    stored += [
                        e for e in decode_batch(payload).events if isinstance(e, BlockStored)
                    ]
            tokens = [t for e in stored for t in e.token_ids]
            assert tokens[: 3 * PAGE] == ids[: 3 * PAGE] and stored[0].parent_block_hash is None
            assert all(e.block_size == PAGE for e in stored)
        finally:
            decode.close()
            prefill.stop()
            sub.close(0)
