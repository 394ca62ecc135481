"""Stage cores (no Triton) of different tensor-parallel sizes (a PrefillWorker and a DecodeWorker
with ``tensor_parallel_size`` 2 and 1, and the reverse), real Mooncake between every rank's
process. The seed case with speculative decoding: an MLA target (latent sent once per decode
rank, by prefill rank 0) with a GQA draft checkpoint on ranks of its own (each prefill rank
sends its draft heads), lossless and accepting what colocated decoding accepts. A prefill rank
killed mid-request fails that request with the rank named, frees its pages and leaves no
process behind; a decode that does not pair with prefill's ranks is refused at the handshake.
(Greedy equality without a draft: test_tp_rank_agents.py and test_e2e_tp.py.)"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from draft_models import hf_greedy_at, mla_target_gqa_draft
from runtime_models import checkpoint, random_prompt
from stagepeer import Collector, tiny_params

from backends.runtime.sampling_params import SamplingParams
from backends.stages.decode import DecodeWorker
from backends.stages.params import StageParams
from backends.stages.prefill import PrefillWorker
from backends.stages.request import StageRequest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
KIND = "qwen2_kv2"


def stages(p_tp: int, d_tp: int, ckpt: str | None = None, **kw):
    ckpt = ckpt or checkpoint(KIND)
    prefill = PrefillWorker(StageParams(**tiny_params(ckpt, tensor_parallel_size=p_tp, **kw)))
    decode = DecodeWorker(StageParams(**tiny_params(ckpt, tensor_parallel_size=d_tp, **kw)))
    return prefill, decode


def run(prefill, decode, room: int, ids: list[int], n: int = 10):
    c = Collector()
    req = StageRequest(room=room, prompt_ids=ids, sampling=SamplingParams(max_tokens=n),
                       bootstrap_addr=prefill.bootstrap_addr, stream=True)  # fmt: skip
    decode.submit(req, c)
    res = prefill.prefill_one(StageRequest(room=room, prompt_ids=ids,
                                           sampling=SamplingParams(max_tokens=1)))  # fmt: skip
    assert c.done.wait(60)
    return c, res


def pages_back(*workers) -> bool:
    end = time.time() + 10
    while time.time() < end and any(w.pages_in_use for w in workers):
        time.sleep(0.05)
    return not any(w.pages_in_use for w in workers)


def colocated_spec(target: str, draft: str, prompts) -> tuple[int, int]:
    """(proposed, accepted) of one-rank colocated speculative decoding on ``prompts``."""
    from backends.runtime.loader import load_runner
    from backends.runtime.spec import DraftSpec, SpecEngine, load_draft
    from backends.stages.params import StageParams

    t = load_runner(target)
    d = load_draft(t, path=draft)
    cut = StageParams.spec_min_confidence  # decode's default: its chains end where it says
    dspec = DraftSpec(d, d.make_pool(64, 4, "draft"), 3, min_confidence=cut)
    engine = SpecEngine(t, t.make_pool(64, 4), dspec)
    engine.generate([(p, SamplingParams(max_tokens=16)) for p in prompts])
    return engine.stats.proposed, engine.stats.accepted


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)])
def test_mla_target_with_a_gqa_draft_across_tp_sizes_is_lossless(p_tp, d_tp):
    target, draft = mla_target_gqa_draft()
    # drafting at every step, as the colocated engine it compares with
    spec = dict(spec_enabled=True, draft_model_dir=draft, spec_tokens=3, spec_adaptive=False)
    prefill, decode = stages(p_tp, d_tp, target, **spec)
    try:
        assert {len(r.worker_pids) for r in (prefill.runner, prefill.draft) if p_tp > 1} <= {1}
        prompts = [random_prompt(n, seed=n) for n in (9, 21)]
        for room, ids in enumerate(prompts, 5):
            c, res = run(prefill, decode, room, ids, 16)
            assert res.error is None and c.events[-1].error is None, c.events[-1].error
            assert c.ids == hf_greedy_at(target, ids, 16)
        # the draft KV every rank sent is the draft KV colocated decoding computes: the same
        # proposals are accepted (a wrong head slice would only lower acceptance)
        st, colo = decode.stats(), colocated_spec(target, draft, prompts)
        assert (st["spec_proposed"], st["spec_accepted"]) == colo and colo[1] > 0
        assert pages_back(prefill, decode)
    finally:
        decode.close()
        prefill.close()


def test_a_killed_prefill_rank_fails_its_request_naming_it_and_frees_every_page():
    prefill, decode = stages(2, 1)
    (pid,) = prefill.runner.worker_pids
    try:
        send = prefill.sender.send_group
        killed = threading.Event()

        def kill_after_first_group(room, role, layers, fence=None):
            send(room, role, layers, fence)
            if not killed.is_set():  # rank 1 dies between two layer groups of the forward
                killed.set()
                os.kill(pid, signal.SIGKILL)

        prefill.sender.send_group = kill_after_first_group
        c, res = run(prefill, decode, 3, random_prompt(13, seed=2))
        assert res.error and "tensor-parallel rank 1 died (exit code -9)" in res.error
        assert c.events[-1].error and "prefill" in c.events[-1].error
        assert pages_back(prefill, decode)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # reaped: no orphan, no zombie
    finally:
        decode.close()
        prefill.close()


def test_a_decode_whose_ranks_do_not_pair_with_prefills_is_refused_at_once():
    """Prefill over 2 ranks, decode's second rank hidden from the Register: head 1 of 2 would
    have nowhere to go. The request fails at the handshake naming the heads, not later."""
    prefill, decode = stages(2, 2)
    decode.receiver.staging.rank_dests = lambda: []  # Register lists rank 0 only
    try:
        t0 = time.time()
        c, res = run(prefill, decode, 4, random_prompt(9, seed=1))
        assert time.time() - t0 < 10
        assert "incompatible tensor parallelism" in c.events[-1].error
        assert "not all 2" in c.events[-1].error
        assert pages_back(prefill, decode)
    finally:
        decode.close()
        prefill.close()


HYBRID_ENTRY = {
    "qwen3_next": "target.state",
    "nemotron_h": "target.state",
    "gpt_oss": "target.window",
}


@pytest.mark.parametrize("kind", list(HYBRID_ENTRY))
@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)])
def test_a_hybrid_s_state_crosses_tp_sizes(kind, p_tp, d_tp):
    """Each prefill rank's state groups land in the decode rank(s) holding those groups, every
    sub-block of the slot (conv channels, recurrent state) cut on its own, and a sliding-window
    entry's heads the same way (only its window's pages): greedy output equals transformers',
    and every page and slot comes back."""
    from runtime_models import hf_greedy

    prefill, decode = stages(p_tp, d_tp, checkpoint(kind))
    try:
        assert HYBRID_ENTRY[kind] in decode.pools
        for room, n in enumerate((7, 33), 30):
            ids = random_prompt(n, seed=n)
            c, res = run(prefill, decode, room, ids, 12)
            assert res.error is None and c.events[-1].error is None, c.events[-1].error
            assert c.ids == hf_greedy(kind, ids, 12)
        assert pages_back(prefill, decode)
    finally:
        decode.close()
        prefill.close()
