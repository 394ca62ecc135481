"""Batched and chunked prefill in the prefill stage (own process, real Mooncake) -> decode:
16 rooms in ONE forward each equal transformers' greedy output (what one-at-a-time prefill gives,
tests/integration/test_stages_direct.py); one failing room of a batch fails alone; a prompt
longer than ``max_prefill_tokens`` prefilled in chunks equals the unchunked output; a burst
registered one room at a time is gathered into one forward."""

from __future__ import annotations

import time

import pytest
from runtime_models import checkpoint, hf_greedy, random_prompt
from stagepeer import Collector, PrefillProcess, tiny_params

from backends.runtime.sampling_params import SamplingParams
from backends.stages.decode import DecodeWorker
from backends.stages.params import StageParams
from backends.stages.request import StageRequest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
NEW = 6


def _decode_all(decode: DecodeWorker, prefill: PrefillProcess, prompts: dict[int, list[int]],
                gap_s: float = 0.0):  # fmt: skip
    outs = {}
    for room, ids in prompts.items():  # decode registers first, as in the ensemble
        c = Collector()
        req = StageRequest(room=room, prompt_ids=ids, sampling=SamplingParams(max_tokens=NEW),
                           bootstrap_addr=prefill.addr, stream=True)  # fmt: skip
        decode.submit(req, c)
        outs[room] = c
        time.sleep(gap_s)
    return outs


def _pages_back(decode: DecodeWorker, prefill: PrefillProcess) -> None:
    end = time.time() + 10
    while time.time() < end and (decode.pages_in_use or prefill.pages_in_use()):
        time.sleep(0.1)
    assert decode.pages_in_use == 0 and prefill.pages_in_use() == 0


def test_sixteen_rooms_in_one_forward_equal_their_reference_and_fail_alone():
    """Two batches of 16 in one prefill process: all good, then one room whose sends fail."""
    ckpt = checkpoint("llama")
    bad = 321
    params = tiny_params(ckpt, num_pages=256, prefill_batch_tokens=1024)  # 16 prompts: 648 tokens
    prefill = PrefillProcess(batch_of=16, fail_room=bad, **params)
    decode = DecodeWorker(StageParams(**params))
    try:
        for base in (300, 316):
            prompts = {base + i: random_prompt(3 + 5 * i, seed=base + i) for i in range(16)}
            outs = _decode_all(decode, prefill, prompts)  # 3..78 tokens
            results, sizes = prefill.submit_all(list(prompts.items()))
            assert sizes[-1] == 16, sizes  # one forward for all of them
            for (room, ids), (first, err) in zip(prompts.items(), results, strict=True):
                c = outs[room]
                assert c.done.wait(60)
                if room == bad:
                    assert first is None and "injected send failure" in err
                    assert c.events[-1].error, c.events[-1]
                    continue
                assert err is None, err
                want = hf_greedy("llama", ids, NEW)
                assert first == want[0] and c.ids == want, room
            _pages_back(decode, prefill)
    finally:
        decode.close()
        prefill.stop()


def test_a_burst_that_decode_registers_one_room_at_a_time_goes_in_one_forward():
    """As in serving, prefill holds the burst's requests before decode registers them, one room
    at a time: the compute thread gathers the burst (``prefill_gather_ms``) instead of starting
    the first room alone."""
    ckpt = checkpoint("llama")
    # the window only bounds the wait (it ends at the last registration): 3 s, because on a
    # loaded CI host the 12th registration once came more than 1 s after the submits ([10, 1, 1])
    params = tiny_params(ckpt, num_pages=256, prefill_batch_tokens=1024, prefill_gather_ms=3000)
    prefill = PrefillProcess(**params)
    decode = DecodeWorker(StageParams(**params))
    try:
        prompts = {500 + i: random_prompt(3 + 5 * i, seed=500 + i) for i in range(12)}
        prefill.conn.send(("submit_all", list(prompts.items())))  # every room waits for decode
        time.sleep(0.3)
        outs = _decode_all(decode, prefill, prompts, gap_s=0.03)  # registrations trickle in
        results, sizes = prefill.conn.recv()
        assert sizes == [12], sizes
        for (room, ids), (first, err) in zip(prompts.items(), results, strict=True):
            assert err is None and outs[room].done.wait(60), err
            assert outs[room].ids == hf_greedy("llama", ids, NEW) and first == outs[room].ids[0]
        _pages_back(decode, prefill)
    finally:
        decode.close()
        prefill.stop()


def test_a_prompt_longer_than_the_budget_is_prefilled_in_chunks():
    ckpt = checkpoint("llama")
    params = tiny_params(ckpt, max_prefill_tokens=16)
    prefill = PrefillProcess(**params)  # 61 tokens: chunks of 16, 16, 16, 13
    decode = DecodeWorker(StageParams(**params))
    try:
        prompts = {400: random_prompt(61, seed=9), 401: random_prompt(16, seed=10)}
        outs = _decode_all(decode, prefill, prompts)
        for room, ids in prompts.items():
            first, err = prefill.prefill(room, ids)
            assert err is None, err
            assert outs[room].done.wait(60)
            assert outs[room].ids == hf_greedy("llama", ids, NEW) and first == outs[room].ids[0]
        _pages_back(decode, prefill)
    finally:
        decode.close()
        prefill.stop()
