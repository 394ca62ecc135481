"""Speculative decoding through the real Triton ensemble: greedy output equals the target's
greedy output (transformers), for the default model with a self-draft and for a tiny random MLA
target (DeepSeek-V3) with a tiny random GQA draft (Llama) or an EAGLE head (its own GQA KV and
the target's feature sent by prefill), and a tiny Llama with a trained head; the acceptance
counters in the metrics equal those of the colocated speculative engine on the same prompts.

Each test starts its own tritonserver (make_repo copy with ``spec_enabled``), one instance per
stage, and stops it at the end.
"""

from __future__ import annotations

import time

import pytest
from draft_models import hf_greedy_at, mla_target_gqa_draft
from eagle_heads import random_head, trained_head
from runtime_models import checkpoint, random_prompt
from triton_harness import (
    MODEL,
    assert_greedy,
    generated_ids,
    launch,
    metrics,
    stop,
    wait_pages_free,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

MAX_TOKENS = 32
BASE = ["num_pages=128", "max_context=512", "max_tokens_limit=256", "bootstrap_timeout_s=20",
        "decode.spec_adaptive=false"]  # drafting every step, as the colocated engines compared


def _spec_metrics(srv) -> dict[str, float]:
    m = metrics(srv)
    return {k[0]: v for k, v in m.items() if k[0].startswith("pd_spec") and k[1] == "decode"}


def _wait_metric(srv, name: str, value: float, timeout: float = 5.0) -> dict[str, float]:
    """Metrics refresh every 0.25 s: poll until ``name`` reaches ``value``."""
    end = time.time() + timeout
    while True:
        m = _spec_metrics(srv)
        if m.get(name, 0.0) >= value or time.time() > end:
            return m


def colocated_stats(model_dir: str, spec: dict, prompts: list[list[int]]) -> dict[str, float]:
    """The colocated SpecEngine (same target, same draft, one process) on the same prompts."""
    import torch

    from backends.runtime.loader import load_runner
    from backends.runtime.sampling_params import SamplingParams
    from backends.runtime.spec import DraftSpec
    from backends.runtime.spec_eagle import spec_engine
    from backends.stages.draft import load_stage_draft, make_draft_pool
    from backends.stages.params import StageParams

    torch.set_num_threads(1)
    params = StageParams(model_dir=model_dir, num_pages=64, page_size=4, **spec)
    target = load_runner(params.model_path)
    draft = load_stage_draft(params, target)
    dspec = DraftSpec(draft, make_draft_pool(params, draft), params.spec_tokens,
                      min_confidence=params.spec_min_confidence)  # fmt: skip
    engine = spec_engine(target, target.make_pool(64, 4), dspec, max_batch=1)
    engine.generate([(p, SamplingParams(max_tokens=MAX_TOKENS)) for p in prompts])
    st = engine.stats
    return {
        "pd_spec_proposed_tokens_total": st.proposed,
        "pd_spec_accepted_tokens_total": st.accepted,
        "pd_spec_verify_steps_total": st.verify_steps,
    }


def test_self_draft_default_model_equals_target_greedy(tmp_path, reference):
    sets = [*BASE, "spec_enabled=true", "draft_layers=24", "decode.spec_tokens=2"]
    srv, serve, env = launch(tmp_path, sets)
    try:
        prompts = [("What is the capital of France?", True), ("Write a haiku about the sea.", True)]
        assert_greedy(srv, reference, prompts, MAX_TOKENS)  # streamed, then not
        spec = dict(spec_enabled=True, draft_layers=24, spec_tokens=2)
        colo = colocated_stats(MODEL, spec, [reference.prompt_ids(t, c) for t, c in prompts])
        m = _wait_metric(srv, "pd_spec_verify_steps_total", colo["pd_spec_verify_steps_total"])
        assert {k: m[k] for k in colo} == colo  # acceptance through Triton == colocated
        assert m["pd_spec_accepted_tokens_total"] > 0
        assert 0 < m["pd_spec_acceptance_rate"] <= 1
        assert m["pd_spec_mean_accepted_length"] > 1
        print(f"self-draft K=24 k=2 through Triton: {m}")
        used = wait_pages_free(srv)
        assert used[("pd_kv_pages_in_use", "prefill")] == 0
        assert used[("pd_kv_pages_in_use", "decode")] == 0
    finally:
        stop(srv, serve, env)


@pytest.mark.parametrize("kind", ["gqa-draft", "eagle-head", "gqa-target-trained-head"])
def test_tiny_target_and_draft_equal_transformers(tmp_path, kind):
    """The seed case: an MLA target whose draft KV is GQA, from a draft model or an EAGLE
    head (random: losslessness must not depend on its quality); and a GQA target (Llama) with
    a head trained by scripts/train_eagle.py. One prompt streamed and one not."""
    target, draft = mla_target_gqa_draft()  # vocab 256 both; they agree about half the time
    if kind == "eagle-head":
        draft = random_head(target)
    elif kind == "gqa-target-trained-head":
        target = checkpoint("llama")
        draft = trained_head(target)
    sets = [
        *BASE,
        f"prefill.model_dir={target}",
        f"decode.model_dir={target}",
        f"preprocess.model_dir={MODEL}",  # tokenizer stages: ids < 256 are valid there too
        f"postprocess.model_dir={MODEL}",
        "spec_enabled=true",
        f"draft_model_dir={draft}",
        "decode.spec_tokens=3",
        "page_size=4",  # prompts span several pages of both pools
    ]
    srv, serve, env = launch(tmp_path, sets)
    try:
        prompts = [random_prompt(n, seed=n) for n in (7, 23)]
        for ids, stream in zip(prompts, (True, False), strict=True):
            want = hf_greedy_at(target, ids, MAX_TOKENS)
            got = generated_ids(srv, {"input_ids": ids, "max_tokens": MAX_TOKENS}, stream)
            assert got == want
        spec = dict(spec_enabled=True, draft_model_dir=draft, spec_tokens=3)
        colo = colocated_stats(target, spec, prompts)
        m = _wait_metric(srv, "pd_spec_verify_steps_total", colo["pd_spec_verify_steps_total"])
        assert {k: m[k] for k in colo} == colo  # acceptance through Triton == colocated
        if kind != "eagle-head":  # a random head is hardly ever accepted
            assert m["pd_spec_accepted_tokens_total"] > 0
        print(f"MLA target + {kind} through Triton: {m}")
        used = wait_pages_free(srv)
        assert used[("pd_kv_pages_in_use", "prefill")] == 0
        assert used[("pd_kv_pages_in_use", "decode")] == 0
    finally:
        stop(srv, serve, env)
