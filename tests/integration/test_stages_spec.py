"""Speculative decoding through the disaggregated stages (no Triton, real Mooncake).

PrefillWorker (own process) computes the target's AND the draft's prompt KV and sends both as two
kvtransfer entries of one room; DecodeWorker verifies drafts with a SpecEngine. Checked against
independent references: transformers' greedy output of the target, the draft KV computed
colocated for the same prompt (bytes), and the colocated SpecEngine's acceptance counters.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from draft_models import hf_greedy_at, mla_target_gqa_draft
from eagle_heads import random_head, trained_head
from runtime_models import checkpoint, random_prompt
from stagepeer import Collector, PrefillProcess, tiny_params

from backends.runtime.eagle import EagleHead
from backends.runtime.engine import LLMEngine
from backends.runtime.kv_pool import KVPool
from backends.runtime.loader import load_runner
from backends.runtime.paged import SeqInput
from backends.runtime.sampling_params import SamplingParams
from backends.runtime.spec import DraftSpec
from backends.runtime.spec_eagle import spec_engine
from backends.stages.decode import DecodeWorker
from backends.stages.draft import load_stage_draft
from backends.stages.params import StageParams
from backends.stages.request import StageRequest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

MAX_TOKENS = 16
PROMPTS = [random_prompt(n, seed=40 + n) for n in (5, 17, 8, 30)]


def _params(target: str, **spec) -> dict:
    # drafting at every batch size and step, as the colocated engines these tests compare with
    return tiny_params(target, num_pages=96, spec_max_batch=0, spec_adaptive=False, **spec)


def _mla_gqa() -> tuple[str, dict]:
    target, draft = mla_target_gqa_draft()
    return target, dict(spec_enabled=True, draft_model_dir=draft, spec_tokens=3)


def _self_draft() -> tuple[str, dict]:
    return checkpoint("llama"), dict(spec_enabled=True, draft_layers=2, spec_tokens=2)


def _mla_gqa_fp8() -> tuple[str, dict]:
    target, spec = _mla_gqa()
    return target, dict(spec, kv_cache_dtype="float8_e4m3fn")


def _eagle(kind: str, **more):
    def case() -> tuple[str, dict]:  # a head trained for seconds by scripts/train_eagle.py
        target = checkpoint(kind)
        head = trained_head(target)
        return target, dict(spec_enabled=True, draft_model_dir=head, spec_tokens=3, **more)

    return case


# -> (target checkpoint, spec parameters): an MLA target with a GQA draft checkpoint (they agree
# about half the time), the same with fp8 KV (both entries fp8, each with its own scales), a
# GQA target with a self-draft of its first half, and EAGLE heads (reduced vocabulary) on a GQA
# and an MLA target, and on the GQA target with three chains per sequence (spec_branches) of
# which it verifies its four most confident drafts (spec_max_drafts)
CASES = {"mla-target+gqa-draft": _mla_gqa, "mla-target+gqa-draft-fp8": _mla_gqa_fp8,
         "gqa-self-draft": _self_draft, "gqa-target+eagle-head": _eagle("llama"),
         "mla-target+eagle-head": _eagle("deepseek_v3"),
         "gqa-target+eagle-head-branches":
             _eagle("llama", spec_branches=3, spec_max_drafts=4)}  # fmt: skip


def prompt_kv(pool: KVPool, pages: list[int], n: int) -> torch.Tensor:
    """The KV of the first n token slots held in ``pages``: [layers, (2,) n, ...]."""
    dim = 2 if pool.layout.attn == "gqa" else 1  # [L][2][pages, ps, ..] or [L][pages, ps, ..]
    t = pool.tensor.view(torch.uint8).index_select(dim, torch.tensor(pages))  # any dtype: bytes
    t = t.flatten(dim, dim + 1)  # pages x page_size -> token slots
    return t.narrow(dim, 0, n).clone()


def _wait_free(decode: DecodeWorker, prefill: PrefillProcess) -> None:
    deadline = time.time() + 10
    while time.time() < deadline and (decode.pages_in_use or prefill.pages_in_use()):
        time.sleep(0.1)
    assert decode.pages_in_use == 0 and prefill.pages_in_use() == 0


@pytest.mark.parametrize("case", list(CASES))
def test_spec_disaggregated_equals_colocated_and_transformers(case):
    target_dir, spec = CASES[case]()
    params = _params(target_dir, **spec)
    prefill = PrefillProcess(**params)
    decode = DecodeWorker(StageParams(**params))
    arrived: dict[str, tuple] = {}  # seq id -> (draft KV at hand-off, Sequence)
    add = decode.engine.add_prefilled

    head = isinstance(decode.draft, EagleHead)  # its KV: the prompt's first P - 1 positions
    feature: dict[str, torch.Tensor] = {}

    def spy(seq_id, prompt, pages, first, sp, draft_pages=None, **kw):
        kv = prompt_kv(decode.pools["draft"], draft_pages, len(prompt) - head)
        if kw.get("draft_feature") is not None:
            feature[seq_id] = kw["draft_feature"].clone()
        seq = add(seq_id, prompt, pages, first, sp, draft_pages=draft_pages, **kw)
        arrived[seq_id] = (kv, seq)
        return seq

    decode.engine.add_prefilled = spy
    try:
        decode.pools["draft"].shuffle_free_list(seed=3)  # page tables differ from colocated
        outs = []
        for i, ids in enumerate(PROMPTS):  # decode registers first, as in the ensemble
            c = Collector()
            decode.submit(
                StageRequest(
                    room=300 + i,
                    prompt_ids=ids,
                    sampling=SamplingParams(max_tokens=MAX_TOKENS),
                    bootstrap_addr=prefill.addr,
                    stream=True,
                ),
                c,
            )
            outs.append(c)
        for i, ids in enumerate(PROMPTS):
            assert prefill.prefill(300 + i, ids)[1] is None
        for c in outs:
            assert c.done.wait(60)
        kv_dtype = params.get("kv_cache_dtype", "auto")
        target = load_runner(params["model_dir"], kv_cache_dtype=kv_dtype)
        for pool in decode.pools.values():  # both entries (MLA target, GQA draft) in kv_dtype
            assert pool.layout.dtype == target.kv_dtype
            assert bool(pool.layout.scale_log2) == (kv_dtype != "auto")
        assert decode.pools["target"].layout.scale_log2 == target.kv_scale_log2
        for ids, c in zip(PROMPTS, outs, strict=True):
            assert c.events[-1].error is None, c.events[-1].error
            if kv_dtype == "auto":
                assert c.ids == hf_greedy_at(target_dir, ids, MAX_TOKENS)
            else:  # fp8 KV: target-only greedy over the same fp8 KV (test_runtime_fp8 checks it)
                ref = LLMEngine(target, target.make_pool(96, 4), max_batch=4)
                (seq,) = ref.generate([(ids, SamplingParams(max_tokens=MAX_TOKENS))])
                assert c.ids == seq.output_ids

        # colocated reference: the same target and draft, one process, one SpecEngine
        draft = load_stage_draft(StageParams(**params), target)
        dpool = draft.make_pool(96, 4, role="draft")
        for i, ids in enumerate(PROMPTS):  # the draft KV bytes (and feature) decode received
            pages = dpool.alloc(dpool.pages_needed(len(ids)))
            if head:  # colocated: the target's features, the head over the prompt's pairs
                tpool = target.make_pool(96, 4)
                tp = tpool.alloc(tpool.pages_needed(len(ids)))
                _, (f,) = target.forward(tpool, [SeqInput(ids, 0, tp)], features=True)
                draft.forward_head(dpool, [SeqInput(ids[1:], 0, pages)], [f[:-1]], logits=False)
                assert torch.equal(feature[str(300 + i)], f[-1])  # bit for bit, float32
            else:
                draft.prefill(dpool, ids, pages)
            got = arrived[str(300 + i)][0]
            assert torch.equal(got, prompt_kv(dpool, pages, len(ids) - head)), i
            dpool.free(pages)
        assert len(feature) == (len(PROMPTS) if head else 0)
        k = params["spec_tokens"]
        stage = StageParams(**params)  # decode's chains end where it says, as many as it says
        dspec = DraftSpec(draft, dpool, k, min_confidence=stage.spec_min_confidence,
                          branches=stage.spec_branches,
                          max_drafts=stage.spec_max_drafts)  # fmt: skip
        colo = spec_engine(target, target.make_pool(96, 4), dspec)
        assert decode.engine.draft.branches == stage.spec_branches  # the parameters reached it
        assert decode.engine.draft.max_drafts == stage.spec_max_drafts
        seqs = colo.generate([(ids, SamplingParams(max_tokens=MAX_TOKENS)) for ids in PROMPTS])
        for i, s in enumerate(seqs):
            d = arrived[str(300 + i)][1]
            assert d.output_ids == s.output_ids
            assert (d.num_accepted, d.num_verify_steps) == (s.num_accepted, s.num_verify_steps)
            if head:  # the feature carried in Complete started the head's state
                assert d.draft_len + len(d.draft_feats) == d.num_tokens - 1
        st = decode.stats()
        assert st["spec_proposed"] == colo.stats.proposed > 0
        assert st["spec_accepted"] == colo.stats.accepted
        assert st["spec_mean_accepted_length"] == colo.stats.mean_accepted_length
        # the drafts agree with their target now and then (a head trained for seconds on a
        # random tiny model hardly ever does: its acceptance is checked with SmolLM2 in
        # benchmarks.spec, and forced in test_spec_eagle.py)
        assert st["spec_accepted"] > 0 or head
        print(f"{case}: disaggregated {decode.engine.stats.as_dict()}")
        _wait_free(decode, prefill)
    finally:
        decode.close()
        prefill.stop()


@pytest.mark.parametrize("kind", ["gqa-draft", "eagle-head"])
def test_draft_kv_transfer_failure_fails_the_request_cleanly(kind):
    target, draft = mla_target_gqa_draft()
    if kind == "eagle-head":  # the head's KV is the draft entry; its feature rides Complete
        draft = random_head(target)
    params = _params(target, spec_enabled=True, draft_model_dir=draft)
    prefill = PrefillProcess(fail_role="draft", **params)
    decode = DecodeWorker(StageParams(**params))
    try:
        for room, n in ((11, 9), (12, 21)):
            ids = random_prompt(n, seed=room)
            c = Collector()
            decode.submit(
                StageRequest(
                    room=room,
                    prompt_ids=ids,
                    sampling=SamplingParams(max_tokens=8),
                    bootstrap_addr=prefill.addr,
                    stream=True,
                ),
                c,
            )
            first, err = prefill.prefill(room, ids)
            assert c.done.wait(30)
            # at most the first token, streamed before the KV landed (the one prefill sampled),
            # never one decoded from a partial KV; then the error ends the stream
            assert c.ids in ([], [first])
            error = c.events[-1].error
            assert error and "KV transfer failed" in error and "draft layers" in error, error
            print(f"draft KV failure: {error}")
            assert "prefill failed" not in (err or "")  # prefill computed; the write failed
        assert decode.stats()["failed"] == 2
        _wait_free(decode, prefill)
    finally:
        decode.close()
        prefill.stop()


MISMATCH = {  # prefill spec params, decode spec params, what decode's error names
    # refused at first contact: the draft is part of the deployment fingerprint (protocol 5)
    "decode-only": ({}, {"spec_enabled": True, "draft_layers": 2}, "prefill none, decode self:2"),
    "prefill-only": ({"spec_enabled": True, "draft_layers": 2}, {}, "prefill self:2, decode none"),
    "other-draft": (
        {"spec_enabled": True, "draft_layers": 2},
        {"spec_enabled": True, "draft_layers": 3},
        "prefill self:2, decode self:3",
    ),
    # two EAGLE heads (trained vs random weights, same shapes): the digest of each head's
    # config and weights differs
    "other-head": lambda: (
        {"spec_enabled": True, "draft_model_dir": trained_head(checkpoint("llama"))},
        {"spec_enabled": True, "draft_model_dir": random_head(checkpoint("llama"), 96)},
        "prefill eagle v1 (feature final_norm, draft vocab 96) ",
    ),
    # heads of two draft vocabularies: the refusal names both (protocol 8)
    "other-vocabulary": lambda: (
        {"spec_enabled": True, "draft_model_dir": random_head(checkpoint("llama"), 96)},
        {"spec_enabled": True, "draft_model_dir": random_head(checkpoint("llama"), 64)},
        "draft vocab 96) ",
    ),
    "head-vs-draft-model": lambda: (
        {"spec_enabled": True, "draft_model_dir": random_head(checkpoint("llama"))},
        {"spec_enabled": True, "draft_model_dir": checkpoint("llama")},
        ", decode model ",
    ),
}


@pytest.mark.parametrize("case", list(MISMATCH))
def test_spec_configuration_mismatch_fails_clearly(case):
    spec = MISMATCH[case]
    p_spec, d_spec, want = spec() if callable(spec) else spec
    prefill = PrefillProcess(**_params(checkpoint("llama"), **p_spec))
    decode = DecodeWorker(StageParams(**_params(checkpoint("llama"), **d_spec)))
    try:
        ids = random_prompt(10, seed=1)
        c = Collector()
        decode.submit(
            StageRequest(
                room=5,
                prompt_ids=ids,
                sampling=SamplingParams(max_tokens=4),
                bootstrap_addr=prefill.addr,
                stream=True,
            ),
            c,
        )
        prefill.prefill(5, ids)
        assert c.done.wait(30)
        error = c.events[-1].error
        assert c.ids == [] and error and "draft model differs" in error and want in error, error
        assert "configured identically in prefill and decode" in error
        if case == "other-vocabulary":
            assert "decode eagle v1 (feature final_norm, draft vocab 64) " in error, error
        print(f"{case}: {error}")
        _wait_free(decode, prefill)
    finally:
        decode.close()
        prefill.stop()


@pytest.mark.parametrize("kind", ["self-draft", "eagle-head"])
def test_spec_client_cancel_frees_target_and_draft_pages(kind):
    target, spec = _self_draft()
    if kind == "eagle-head":
        spec = dict(spec_enabled=True, draft_model_dir=random_head(target), spec_tokens=2)
    params = _params(target, **spec)
    prefill = PrefillProcess(**params)
    decode = DecodeWorker(StageParams(**params))
    try:
        ids, flag, c = random_prompt(12, seed=9), threading.Event(), Collector()
        sp = SamplingParams(max_tokens=100, ignore_eos=True)
        decode.submit(
            StageRequest(
                room=21, prompt_ids=ids, sampling=sp, bootstrap_addr=prefill.addr, stream=True
            ),
            c,
            flag.is_set,
        )
        assert decode.pages_in_use > 0 and prefill.prefill(21, ids)[1] is None
        while len(c.ids) < 4:
            time.sleep(0.01)
        flag.set()
        assert c.done.wait(30)
        assert c.events[-1].finish_reason == "cancelled" and len(c.ids) < 100
        assert decode.stats()["cancelled"] == 1
        _wait_free(decode, prefill)  # both pools on both sides
    finally:
        decode.close()
        prefill.stop()


def test_head_streams_the_first_token_before_any_kv_byte_leaves():
    """With an EAGLE head and slow completion fences (a busy GPU stream), decode's client gets
    prefill's first token before any write of the target's or the head's KV starts; the head
    then drafts from the feature Complete carried, and the output equals target-only."""
    target = checkpoint("llama")
    params = _params(target, spec_enabled=True, draft_model_dir=random_head(target), spec_tokens=2)
    prefill = PrefillProcess(fence_delay_s=0.5, **params)
    decode = DecodeWorker(StageParams(**params))
    try:
        ids, c, arrived = random_prompt(20, seed=4), Collector(), []

        def emit(ev):
            arrived.append(time.time())
            c(ev)

        sp = SamplingParams(max_tokens=8)
        decode.submit(StageRequest(room=31, prompt_ids=ids, sampling=sp,
                                   bootstrap_addr=prefill.addr, stream=True), emit)  # fmt: skip
        first, err, _ = prefill.prefill_timed(31, ids)
        assert err is None and c.done.wait(30) and c.events[-1].error is None
        assert c.events[0].token_ids == [first]
        assert c.ids == hf_greedy_at(target, ids, 8)
        writes = [t for t, _ in prefill.fence_log()["writes"]]
        assert writes and arrived[0] < min(writes), (arrived[0], min(writes))
        assert decode.stats()["spec_verify_steps"] > 0  # the head drafted
        _wait_free(decode, prefill)
    finally:
        decode.close()
        prefill.stop()
