"""Stage cores without Triton: PrefillWorker (own process) -> DecodeWorker, real Mooncake."""

from __future__ import annotations

import threading
import time

import pytest
import zmq
from runtime_models import checkpoint, hf_greedy, random_prompt
from stagepeer import Collector, PrefillProcess, tiny_params

from backends.runtime.sampling_params import SamplingParams
from backends.stages.decode import DecodeWorker
from backends.stages.params import StageParams
from backends.stages.request import StageRequest
from kvtransfer import messages as m

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


class _CancelAfter(Collector):
    """A client that cancels once it holds ``n`` tokens, from the emit callback itself: a test
    thread polling for them can wake up after a fast decode has already finished."""

    def __init__(self, n: int, flag: threading.Event):
        super().__init__()
        self.n, self.flag = n, flag

    def __call__(self, ev):
        super().__call__(ev)
        if len(self.ids) >= self.n:
            self.flag.set()


def test_disaggregated_greedy_equals_transformers_and_frees_pages():
    ckpt = checkpoint("llama")
    prefill = PrefillProcess(**tiny_params(ckpt))
    decode = DecodeWorker(StageParams(**tiny_params(ckpt)))
    try:
        prompts = [random_prompt(n, seed=n) for n in (5, 17, 33, 9)]
        outs, cancel_flag = [], threading.Event()
        for i, ids in enumerate(prompts):  # decode registers first, as in the ensemble
            c = Collector()
            req = StageRequest(
                room=100 + i,
                prompt_ids=ids,
                sampling=SamplingParams(max_tokens=12),
                bootstrap_addr=prefill.addr,
                stream=True,
            )
            decode.submit(req, c)
            outs.append(c)
        # a fifth request is cancelled by its client after its first tokens
        long_req = StageRequest(
            room=200,
            prompt_ids=prompts[0],
            sampling=SamplingParams(max_tokens=100, ignore_eos=True),
            bootstrap_addr=prefill.addr,
            stream=True,
        )
        cancelled = _CancelAfter(3, cancel_flag)
        decode.submit(long_req, cancelled, cancel_flag.is_set)
        # prefilled as serving does (one batch): one room at a time, a fast decode could finish
        # each before the next one's KV landed (max_batch 1 on a loaded host)
        rooms = [(100 + i, ids) for i, ids in enumerate(prompts)] + [(200, prompts[0])]
        results, _ = prefill.submit_all(rooms)
        assert [err for _, err in results] == [None] * len(rooms)
        for c in [*outs, cancelled]:
            assert c.done.wait(60)
        for ids, c in zip(prompts, outs, strict=True):
            assert c.events[-1].error is None
            assert c.ids == hf_greedy("llama", ids, 12)
        assert cancelled.events[-1].finish_reason == "cancelled" and len(cancelled.ids) < 100
        stats = decode.stats()
        assert stats["max_batch"] > 1 and stats["cancelled"] == 1
        deadline = time.time() + 10
        while time.time() < deadline and (decode.pages_in_use or prefill.pages_in_use()):
            time.sleep(0.1)
        assert decode.pages_in_use == 0 and prefill.pages_in_use() == 0
    finally:
        decode.close()
        prefill.stop()


def test_decode_refusal_releases_the_prefill_room_at_once():
    ckpt = checkpoint("llama")
    prefill = PrefillProcess(**tiny_params(ckpt))  # bootstrap_timeout_s=10
    decode = DecodeWorker(StageParams(**tiny_params(ckpt)))
    try:
        ids = random_prompt(200, seed=3)
        req = StageRequest(
            room=7,
            prompt_ids=ids,
            sampling=SamplingParams(max_tokens=100),
            bootstrap_addr=prefill.addr,
            stream=True,
        )
        with pytest.raises(ValueError, match="context limit"):
            decode.submit(req, Collector())
        assert decode.pages_in_use == 0
        t0 = time.time()
        prefill.prefill(7, ids)
        while prefill.pages_in_use() and time.time() - t0 < 10:
            time.sleep(0.05)
        assert prefill.pages_in_use() == 0 and time.time() - t0 < 5  # not the 10 s timeout
    finally:
        decode.close()
        prefill.stop()


def test_local_prefill_on_the_decode_server_needs_no_prefill_and_equals_transformers():
    """A request the router marked LOCAL (conditional disaggregation) is prefilled by decode's
    own engine: no prefill exists here at all, no KV pages are registered anywhere."""
    from backends.stages.router import LOCAL

    ckpt = checkpoint("llama")
    decode = DecodeWorker(StageParams(**tiny_params(ckpt)))
    try:
        prompts = [random_prompt(n, seed=n) for n in (6, 21)]
        outs = []
        for i, ids in enumerate(prompts):
            c = Collector()
            req = StageRequest(
                room=300 + i, prompt_ids=ids, sampling=SamplingParams(max_tokens=10),
                bootstrap_addr=LOCAL, stream=i == 0,
            )  # fmt: skip
            decode.submit(req, c)
            outs.append(c)
        for ids, c in zip(prompts, outs, strict=True):
            assert c.done.wait(60)
            assert c.events[-1].error is None
            assert c.ids == hf_greedy("llama", ids, 10)
        st = decode.stats()
        assert st["local_prefills"] == 2 and st["rooms_ok"] == 0  # no transfer happened
        assert decode.pages_in_use == 0
    finally:
        decode.close()


def test_a_repeated_local_prompt_reports_its_cached_prefix():
    """Decode prefills a prompt itself a second time from its prefix cache: the final event says
    how many prompt tokens came from the cache (usage's cached_tokens), known only once the
    engine scheduled the prompt, and the tokens are the first time's."""
    from backends.stages.router import LOCAL

    params = StageParams(**tiny_params(checkpoint("llama")))
    decode = DecodeWorker(params)
    try:
        ids, got = random_prompt(40, seed=7), []
        for i in range(2):
            c = Collector()
            sampling = SamplingParams(max_tokens=4)
            decode.submit(StageRequest(room=320 + i, prompt_ids=ids, sampling=sampling,
                                       bootstrap_addr=LOCAL), c)  # fmt: skip
            assert c.done.wait(60) and c.events[-1].error is None
            got.append((c.ids, c.events[-1].cached_tokens))
        page = params.page_size
        assert got[0] == (hf_greedy("llama", ids, 4), 0)
        assert got[1] == (got[0][0], page * ((len(ids) - 1) // page))
    finally:
        decode.close()


def test_bad_frames_on_the_cancel_channel_count_as_dropped_frames():
    """Unsigned and stale Cancels cancel nothing and show in the decode stage's dropped-frame
    counters (``pd_dropped_frames_total``)."""
    secret = "cancel-stats-secret-0123456789"
    decode = DecodeWorker(StageParams(**tiny_params(checkpoint("llama")), shared_secret=secret))
    ctx = zmq.Context()
    try:
        before = decode.stats()["dropped_total"]
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(f"tcp://{decode.cancel_addr}")
        push.send(m.encode(m.Cancel(5)))
        push.send(m.encode(m.Cancel(6), secret.encode(), now=time.time() - 3600))
        deadline = time.time() + 10
        while time.time() < deadline and decode.stats()["dropped_total"] < before + 2:
            time.sleep(0.05)
        stats = decode.stats()
        assert stats["dropped_total"] == before + 2, stats
        assert stats["dropped_frames"]["cancel_auth"] == 1, stats
        assert stats["dropped_frames"]["cancel_stale"] == 1, stats
        assert stats["cancelled"] == 0
    finally:
        ctx.destroy(linger=0)
        decode.close()
