"""Per-group completion fences in the prefill stage: a real PrefillWorker (own process, slow
injected fences as a busy GPU stream would give), real Mooncake, a real DecodeWorker."""

from __future__ import annotations

import pytest
from runtime_models import checkpoint, hf_greedy, random_prompt
from stagepeer import Collector, PrefillProcess, tiny_params

from backends.runtime.sampling_params import SamplingParams
from backends.stages.decode import DecodeWorker
from backends.stages.params import StageParams
from backends.stages.request import StageRequest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

FENCE_DELAY_S = 0.5


def test_slow_fences_hold_each_groups_writes_but_never_the_compute():
    params = tiny_params(checkpoint("llama"))  # 4 layers: 4 groups of 1
    prefill = PrefillProcess(fence_delay_s=FENCE_DELAY_S, **params)
    decode = DecodeWorker(StageParams(**params))
    try:
        ids, c = random_prompt(40, seed=2), Collector()
        sp = SamplingParams(max_tokens=8)
        req = StageRequest(room=11, prompt_ids=ids, sampling=sp, bootstrap_addr=prefill.addr)
        decode.submit(req, c)
        first, err, timing = prefill.prefill_timed(11, ids)
        assert err is None and c.done.wait(30)
        assert c.events[-1].error is None and c.ids == hf_greedy("llama", ids, 8)
        log = prefill.fence_log()
        groups = timing["groups"]  # [first layer, end layer, time handed over]
        assert [g[:2] for g in groups] == [[i, i + 1] for i in range(4)]
        assert len(log["fences"]) == 4
        # later groups computed while earlier groups' fences were still pending
        assert max(g[2] for g in groups) < log["fences"][0]
        base, slab = log["layout"]  # a write's source address -> its layer
        for layer, ready_at in enumerate(log["fences"]):
            sent = [t for t, src in log["writes"] if (src - base) // slab == layer]
            assert sent and min(sent) >= ready_at, (layer, sent, ready_at)
        # the fences were polled, by transfer workers only
        assert log["pollers"] and log["compute_thread"] not in log["pollers"]
    finally:
        decode.close()
        prefill.stop()
