"""The real default model with a self-draft: greedy speculative output equals target-only.

An untrained early exit agrees poorly with the full model (transformers' own hidden states give
~0% top-1 agreement after 8 of 30 layers, ~30% after 24), so K = 24 is used here to exercise
the accept paths; K = 8 is checked for equality only.
"""

from __future__ import annotations

import os

import pytest

from backends.runtime.engine import LLMEngine
from backends.runtime.loader import load_runner
from backends.runtime.sampling_params import SamplingParams
from backends.runtime.spec import DraftSpec, SpecEngine, self_draft
from backends.runtime.tokenizer import Tokenizer

MODEL = os.path.join(os.path.dirname(__file__), "..", "..", "models", "smollm2-135m-instruct")
PROMPTS = [("What is the capital of France?", True), ("Write a haiku about the sea.", True)]

pytestmark = pytest.mark.slow  # needs the default model (scripts/setup.sh converts it)


def test_self_draft_greedy_equals_target_only():
    tok = Tokenizer(MODEL)
    target = load_runner(MODEL)
    reqs = [(tok.encode(t, chat=c), SamplingParams(max_tokens=32)) for t, c in PROMPTS]
    expected = [s.output_ids for s in LLMEngine(target, target.make_pool(32, 16)).generate(reqs)]
    assert "Paris" in tok.decode(expected[0])
    for layers, k in ((24, 3), (8, 2)):
        draft = self_draft(target, layers)
        dpool = draft.make_pool(32, 16, "draft")
        engine = SpecEngine(target, target.make_pool(32, 16), DraftSpec(draft, dpool, k))
        seqs = engine.generate(reqs)
        assert [s.output_ids for s in seqs] == expected, layers
        assert engine.pool.num_free == 32 and dpool.num_free == 32
        if layers == 24:
            assert engine.stats.accepted > 0 and engine.stats.mean_accepted_length > 1.2


def _predicted(agree: list[bool], n: int, k: int) -> tuple[int, int]:
    """(accepted drafts, verify steps) of greedy self-draft decoding of n tokens, given where
    the early exit agrees with the full model (teacher forced): a self-draft's KV for its K
    layers is the target's, so draft j is accepted iff it and all before it agree. A step with
    no draft left (the last token) verifies nothing and is no verify step."""
    emitted, accepted, steps = 1, 0, 0  # the first token comes from prefill
    while emitted < n:
        k_eff, m = min(k, n - emitted - 1), 0
        while m < k_eff and agree[emitted + m]:
            m += 1
        accepted, steps, emitted = accepted + m, steps + (k_eff > 0), emitted + m + 1
    return accepted, steps


def test_acceptance_matches_transformers_early_exit():
    """Accepted counts equal the ones predicted from transformers' own hidden states."""
    import torch
    from transformers import AutoModelForCausalLM

    layers, k, n = 26, 3, 32
    tok = Tokenizer(MODEL)
    target = load_runner(MODEL)
    hf = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    draft = self_draft(target, layers)
    engine = SpecEngine(
        target, target.make_pool(32, 16), DraftSpec(draft, draft.make_pool(32, 16, "draft"), k)
    )
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    seqs = engine.generate([(tok.encode(t, chat=c), params) for t, c in PROMPTS])
    total = 0
    for s in seqs:
        ids = torch.tensor([s.prompt_ids + s.output_ids])
        with torch.no_grad():
            out = hf(ids, output_hidden_states=True)
        rows = slice(len(s.prompt_ids) - 1, -1)  # the positions that predicted output tokens
        assert out.logits[0, rows].argmax(-1).tolist() == s.output_ids
        early = hf.lm_head(hf.model.norm(out.hidden_states[layers][0, rows])).argmax(-1)
        agree = [int(a) == b for a, b in zip(early, s.output_ids, strict=True)]
        assert (s.num_accepted, s.num_verify_steps) == _predicted(agree, n, k)
        total += s.num_accepted
    assert total > 0
