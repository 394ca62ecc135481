"""Greedy speculative decoding emits exactly the target-only greedy tokens."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import runtime_models as rm
import spec_models as sm
import torch

from backends.runtime.loader import load_runner
from backends.runtime.paged import SeqInput
from backends.runtime.sequence import FinishReason
from backends.runtime.spec import DraftSpec, SpecEngine, load_draft, self_draft

PROMPTS = [rm.random_prompt(n, seed=n) for n in (1, 4, 9, 14, 6)]
MAX_TOKENS = [20, 9, 16, 3, 12]


def _run_batch(engine, target):
    seqs = engine.generate(
        [(p, sm.greedy(m)) for p, m in zip(PROMPTS, MAX_TOKENS, strict=True)], prefix="spec"
    )
    for p, m, s in zip(PROMPTS, MAX_TOKENS, seqs, strict=True):
        assert s.output_ids == sm.reference(target, p, sm.greedy(m)), p
        assert s.finish_reason == FinishReason.LENGTH
    assert engine.pool.num_free == engine.pool.num_pages
    assert engine.draft.pool.num_free == engine.draft.pool.num_pages
    return seqs


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
def test_self_draft_equals_target_only(kind, llama, mla):
    target = llama if kind == "llama" else mla
    engine = sm.spec_engine(target, self_draft(target, 1), k=3)
    _run_batch(engine, target)
    assert engine.stats.proposed > 0


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
def test_full_depth_draft_accepts_everything(kind, llama, mla):
    """A draft identical to the target: every draft accepted, every step ends with a bonus."""
    target = llama if kind == "llama" else mla
    engine = sm.spec_engine(target, self_draft(target, target.config.num_layers), k=4)
    seqs = _run_batch(engine, target)
    assert engine.stats.acceptance_rate == 1.0
    for s, m in zip(seqs, MAX_TOKENS, strict=True):  # first token at admission, then 5 per step
        # a last single token is a plain step (k clamped to 0): it verifies no draft
        assert s.num_verify_steps == (m - 1) // 5 + ((m - 1) % 5 > 1)


def test_steps_above_max_batch_draft_nothing_then_drafting_resumes(llama):
    """DraftSpec.max_batch = 2: while more sequences run, each step verifies one token per
    sequence and proposes nothing; once two remain, the draft catches up the tokens it missed
    and drafts again (a full-depth draft is then accepted every time: its KV caught up right)."""
    full = self_draft(llama, llama.config.num_layers)
    engine = sm.spec_engine(llama, full, k=3, spec_max_batch=2)
    seqs = dict(zip(MAX_TOKENS, _run_batch(engine, llama), strict=True))
    assert [seqs[m].num_proposed for m in (3, 9, 12)] == [0, 0, 0]  # ended while > 2 ran
    assert seqs[20].num_proposed > 0 and seqs[16].num_proposed > 0
    assert engine.stats.acceptance_rate == 1.0
    with pytest.raises(ValueError, match="max_batch must be an integer >= 0"):
        DraftSpec(full, engine.draft.pool, 3, -1)


def test_mla_target_with_gqa_draft(mla):
    draft = load_runner(rm.checkpoint("llama"))  # same 256-token vocabulary
    engine = sm.spec_engine(mla, draft, k=2, draft_page_size=8)
    assert engine.pool.layout.attn == "mla" and engine.draft.pool.layout.attn == "gqa"
    _run_batch(engine, mla)


def test_mixed_accepted_lengths_in_one_batch(llama):
    engine = sm.spec_engine(llama, sm.noisy_draft(llama, 0.3), k=3)
    engine.pool.shuffle_free_list(seed=3)
    engine.draft.pool.shuffle_free_list(seed=4)
    seqs = _run_batch(engine, llama)
    assert 0.2 < engine.stats.acceptance_rate < 0.9  # partial acceptance
    per_step = {round(s.num_accepted / s.num_verify_steps, 3) for s in seqs if s.num_verify_steps}
    assert len(per_step) > 2  # sequences advanced by different amounts in the same steps


def test_equals_transformers_greedy(llama):
    engine = sm.spec_engine(llama, sm.noisy_draft(llama, 0.3), k=3)
    for i, p in enumerate(PROMPTS[:3]):
        s = engine.generate([(p, sm.greedy(16, ignore_eos=False))], prefix=f"hf{i}")[0]
        assert s.output_ids == rm.hf_greedy("llama", p, 16)


def test_stop_at_eos_inside_accepted_run(llama):
    prompt = PROMPTS[2]
    full = sm.reference(llama, prompt, sm.greedy(16))
    eos = full[8]  # tokens 6..10 come from the second verify step (5 per step)
    assert 6 < full.index(eos) < 10  # so EOS lands in the middle of an accepted run
    stop = copy.copy(llama)
    stop.config = dataclasses.replace(llama.config, eos_token_ids=(eos,))
    engine = sm.spec_engine(stop, self_draft(stop, stop.config.num_layers), k=4)
    s = engine.generate([(prompt, sm.greedy(16, ignore_eos=False))])[0]
    assert s.output_ids == full[: full.index(eos) + 1] and s.finish_reason == FinishReason.STOP
    assert engine.pool.num_free == 64 and engine.draft.pool.num_free == 64


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 7])
def test_max_tokens_with_exact_page_reservation(llama, max_tokens):
    """k is clamped near the end: nothing is written past prompt + max_tokens - 1 slots."""
    prompt = PROMPTS[1]  # 4 tokens
    need = -(-(len(prompt) + max_tokens - 1) // 2)
    full = self_draft(llama, llama.config.num_layers)
    engine = sm.spec_engine(llama, full, k=4, pages=need, page_size=2, draft_page_size=2)
    s = engine.generate([(prompt, sm.greedy(max_tokens))])[0]
    assert s.output_ids == sm.reference(llama, prompt, sm.greedy(max_tokens))
    assert len(s.output_ids) == max_tokens
    assert engine.pool.num_free == need and engine.draft.pool.num_free == need


def test_abort_frees_both_pools(llama):
    engine = sm.spec_engine(llama, self_draft(llama, 2), k=3, pages=20, max_batch=1)
    engine.add_request("a", PROMPTS[2], sm.greedy(20))
    engine.add_request("b", PROMPTS[3], sm.greedy(20))
    engine.step()
    engine.step()
    assert engine.pool.num_free < 20 and engine.draft.pool.num_free < 20
    assert engine.abort("a").finish_reason == FinishReason.ABORT  # running
    assert engine.abort("b").finish_reason == FinishReason.ABORT  # waiting
    assert engine.abort("a") is None
    assert engine.pool.num_free == 20 and engine.draft.pool.num_free == 20


def test_draft_pool_pages_gate_admission(llama):
    """A request is admitted only when BOTH pools have its pages."""
    target_pool = llama.make_pool(40, 4)
    draft = self_draft(llama, 1)
    engine = SpecEngine(llama, target_pool, DraftSpec(draft, draft.make_pool(6, 4, "draft"), 2))
    for i in range(2):  # each needs 5 draft pages: one at a time
        engine.add_request(f"r{i}", rm.random_prompt(10, seed=i), sm.greedy(10))
    out = engine.step()
    assert list(out.new_tokens) == ["r0"] and len(engine.waiting) == 1
    while engine.has_unfinished():
        engine.step()
    assert target_pool.num_free == 40 and engine.draft.pool.num_free == 6


def test_self_draft_shares_target_weights(llama):
    d = self_draft(llama, 2)
    assert d.config.num_layers == 2 and len(d.model.layers) == 2
    assert d.model.layers[0] is llama.model.layers[0] and d.model.lm_head is llama.model.lm_head
    assert llama.config.num_layers == 4 and len(llama.model.layers) == 4  # target untouched


def test_incompatible_draft_is_refused(llama):
    other = copy.copy(llama)
    other.config = dataclasses.replace(llama.config, vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary"):
        SpecEngine(llama, llama.make_pool(8, 4), DraftSpec(other, other.make_pool(8, 4), 2))
    with pytest.raises(ValueError, match="exactly one"):
        load_draft(llama)
    with pytest.raises(ValueError, match="num_spec_tokens"):
        DraftSpec(llama, llama.make_pool(8, 4), 0)


def test_self_draft_equals_transformers_early_exit(llama):
    """Self-draft K = transformers' hidden state after K layers -> final norm -> LM head; and the
    same as loading the checkpoint truncated to K layers."""
    prompt = PROMPTS[3]
    hf = rm.hf_model("llama")
    with torch.no_grad():
        h = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states[2][0, -1]
        ref = hf.lm_head(hf.model.norm(h))
    draft = self_draft(llama, 2)
    got = draft.prefill(draft.make_pool(8, 4, "draft"), prompt, [0, 1, 2, 3])
    rm.assert_close_to_reference(got, ref)
    loaded = load_runner(rm.checkpoint("llama"), num_layers=2)
    torch.testing.assert_close(loaded.prefill(loaded.make_pool(8, 4), prompt, [0, 1, 2, 3]), got)


def test_forward_last_only_equals_full_logits(llama):
    pool = llama.make_pool(16, 4)
    seqs = [SeqInput(PROMPTS[i], 0, [4 * i + j for j in range(4)]) for i in (1, 2, 3)]
    full = llama.forward(pool, seqs)
    last = llama.forward(pool, seqs, last_only=True)
    for f, la in zip(full, last, strict=True):
        assert la.shape == (1, f.shape[1])
        torch.testing.assert_close(la, f[-1:])
