"""Adaptive drafting (backends/runtime/draft_policy.py): the policy stops drafting for a sequence,
and for new ones, when the tokens per verify step fall under the measured cost ratio of a
drafted step to a plain one, probes now and then, and resumes when drafting pays again; the
engines stay lossless through every switch (greedy output equal to target-only, sampled tokens
from the target's distribution)."""

from __future__ import annotations

import pytest
import runtime_models as rm
import spec_models as sm
import torch
from eagle_heads import add_same_prompt, random_head

from backends.runtime.draft_policy import AdaptiveDrafting, DraftPolicy
from backends.runtime.sampling_params import SamplingParams
from backends.runtime.spec import DraftSpec, SpecEngine, load_draft, self_draft
from backends.runtime.spec_eagle import spec_engine

PROMPTS = [rm.random_prompt(n, seed=n) for n in (1, 4, 9, 14, 6)]
MAX_TOKENS = [40, 9, 33, 3, 24]


def _run(policy: DraftPolicy, seq: str, steps: int, tokens: float, k: int = 3) -> list[bool]:
    """``steps`` steps of one sequence alone whose drafted steps give ``tokens`` each."""
    plan = []
    for _ in range(steps):
        (go,) = policy.plan([seq])
        plan.append(go)
        if go:
            policy.observe(seq, k, int(tokens) - 1)
    return plan


def test_a_useless_draft_switches_off_probes_and_backs_off():
    """1 token per verify step against r = 1.4: off after 2 steps, then a 4-step probe after
    4 steps undrafted, then after 8, 16 (the backoff doubles, up to 4x here)."""
    cfg = AdaptiveDrafting(probe_interval=4, probe_steps=4, max_backoff=4, cost_ratio=1.4)
    p = DraftPolicy(cfg)
    plan = _run(p, "a", 62, 1.0)
    drafted = [i for i, go in enumerate(plan) if go]
    assert drafted[:2] == [0, 1] and not plan[2]
    runs, start = [], drafted[0]  # (first step, length) of each drafted run
    for i, j in zip(drafted, drafted[1:] + [None], strict=True):
        if j != i + 1:
            runs.append((start, i - start + 1))
            start = j
    assert [n for _, n in runs] == [2, 4, 4, 4, 4]
    gaps = [b - (a + n) for (a, n), (b, _) in zip(runs, runs[1:], strict=False)]
    assert gaps == [4, 8, 16, 16]
    assert p.stats.switched_off == 1 and p.stats.probes == 4
    assert p.server_backoff == 4


def test_a_good_draft_stays_on_and_a_bad_sequence_alone_drops_out():
    """2 tokens per step against r = 1.4: never off. In the same server a sequence at 1.0
    goes off (its own mean outweighs the server's prior) while the good one keeps drafting."""
    p = DraftPolicy(AdaptiveDrafting(probe_interval=64, cost_ratio=1.4))
    assert all(_run(p, "good", 50, 2.0))
    plan = []
    for _ in range(40):
        go = p.plan(["good", "bad"])
        plan.append(go)
        for sid, g, t in zip(("good", "bad"), go, (2.0, 1.0), strict=True):
            if g:
                p.observe(sid, 3, int(t) - 1)
    assert all(g for g, _ in plan)
    assert not all(b for _, b in plan) and not plan[-1][1]
    assert p.stats.switched_off == 1
    assert p.estimate("good") > 1.4 and p.seqs["bad"].accept.value == 1.0


def test_a_sequence_near_the_cost_ratio_drafts_on_one_clearly_under_it_stops():
    """Both estimates are noisy, so a sequence switches off only when clearly slower than plain
    decoding: 1.5 tokens per verify step against r = 1.6 is inside the 10 % margin (it drafts
    every step; with no margin it would go off), 1.0 is not."""
    p = DraftPolicy(AdaptiveDrafting(probe_interval=64, cost_ratio=1.6))
    plan = []
    for i in range(60):
        (go,) = p.plan(["near"])
        plan.append(go)
        if go:
            p.observe("near", 3, (i + 1) % 2)  # 2 and 1 tokens in turn
    assert all(plan) and p.stats.switched_off == 0
    assert 1.6 / 1.1 < p.estimate("near") < 1.6
    assert _run(p, "under", 20, 1.0)[-1] is False and p.stats.switched_off == 1
    strict = DraftPolicy(AdaptiveDrafting(probe_interval=64, cost_ratio=1.6, margin=0.0))
    for i in range(60):
        if strict.plan(["near"])[0]:
            strict.observe("near", 3, (i + 1) % 2)
    assert strict.stats.switched_off == 1


def test_the_margin_keeps_a_drafting_sequence_on_but_does_not_turn_drafting_on():
    """Hysteresis: 1.0 token per verify step against r = 1.1 is within the margin, so the
    sequence drafting since its start drafts on; but a new one starts undrafted (the server's
    mean is under r) and its probes fail: a head that never pays is not kept on by the margin."""
    p = DraftPolicy(AdaptiveDrafting(probe_interval=4, cost_ratio=1.1))
    assert all(_run(p, "first", 20, 1.0))
    plan = _run(p, "next", 40, 1.0)
    assert not plan[0] and sum(plan) < len(plan) / 2


def test_drafting_resumes_when_it_pays_again():
    """A sequence whose drafts start paying while it is off drafts again from its next probe;
    and the server: a new sequence starts off while the server's mean is under r, and on
    once a probe passed."""
    p = DraftPolicy(AdaptiveDrafting(probe_interval=4, cost_ratio=1.4))
    assert _run(p, "a", 5, 1.0) == [True, True, False, False, False]
    assert not p.plan(["new"])[0]  # the server's mean (1.0) < r: it starts undrafted
    assert p.stats.switched_off == 2
    plan = _run(p, "a", 30, 4.0)
    assert plan[-1] and all(plan[plan.index(True) :])  # probe passed: on for good
    assert p.server_backoff == 1
    p.forget("new")
    assert p.plan(["new"])[0]  # the server's mean is over r again


def test_requests_shorter_than_the_probe_interval_still_probe_on_the_server_clock():
    """Once the server is off (its mean under r), each new request starts undrafted, and a
    request of 6 steps never reaches its own probe (after 8 x the backoff). The server's clock
    probes anyway (every 8 x backoff steps with a sequence held off), so when the drafts pay
    again (3 tokens per step) drafting resumes and new requests start drafting."""
    p = DraftPolicy(AdaptiveDrafting(probe_interval=8, cost_ratio=1.4))
    for i in range(4):  # useless drafts: the server goes off
        _run(p, f"bad{i}", 6, 1.0)
        p.forget(f"bad{i}")
    assert not p.plan(["probe-less"])[0]
    p.forget("probe-less")
    plans = []
    for i in range(12):  # the drafts pay now
        plans.append(_run(p, f"good{i}", 6, 3.0))
        p.forget(f"good{i}")
    assert any(any(plan) for plan in plans[:4])  # a probe within 32 steps of the server
    assert all(plans[-1])  # new requests draft from their first step again


def test_cost_ratio_is_measured_per_batch_bucket():
    """r = 1 + (drafted / plain - 1) / f: a step where half the batch drafted at 1.25x a plain
    one means r = 1.5; steps that caught up a long run are not timed; r never drops under
    min_ratio; an unmeasured bucket borrows the nearest one's r."""
    p = DraftPolicy()
    assert p.ratio(1) is None and [p.bucket(b) for b in (1, 2, 3, 4, 5, 8, 9)] == [
        0, 1, 2, 2, 3, 3, 4]  # fmt: skip
    for _ in range(5):
        p.step_time(2, 0, 1.0)
        p.step_time(2, 1, 1.25)
        p.step_time(2, 1, 9.0, timed=False)  # a catch-up: not timed
    assert p.ratio(2) == pytest.approx(1.5)
    assert p.ratio(1) == p.ratio(16) == pytest.approx(1.5)  # borrowed
    p.step_time(1, 0, 1.0)
    p.step_time(1, 1, 0.9)  # faster than plain: noise
    assert p.ratio(1) == pytest.approx(1.05)


def test_cost_probes_time_a_plain_step_when_nobody_does():
    """A drafting bucket with no plain step gets a step where nobody drafts every 4 drafted
    steps until it has 3, then one every cost_every."""
    p = DraftPolicy(AdaptiveDrafting(cost_every=20))
    plans = []
    for _ in range(60):
        go = p.plan(["a", "b"])
        plans.append(any(go))
        p.step_time(2, sum(go), 1.5 if any(go) else 1.0)
        for sid, g in zip(("a", "b"), go, strict=True):
            if g:
                p.observe(sid, 3, 2)  # 3 tokens per step: pays
    plain = [i for i, d in enumerate(plans) if not d]
    assert plain == [4, 9, 14, 35, 56]
    assert p.stats.cost_probes == 5 and p.ratio(2) == pytest.approx(1.5)


def _engine(kind: str, llama, cfg: AdaptiveDrafting, k: int = 3, pages: int = 64,
            page_size: int = 4, max_batch: int = 16) -> SpecEngine:  # fmt: skip
    """A random EAGLE head ("head") or a draft model with a random LM head, under ``cfg``."""
    if kind == "head":
        draft = load_draft(llama, path=random_head(rm.checkpoint("llama")))
    else:
        draft = sm.noisy_draft(llama, 20.0)
    dspec = DraftSpec(draft, draft.make_pool(pages, page_size, role="draft"), k, policy=cfg)
    return spec_engine(llama, llama.make_pool(pages, page_size), dspec, max_batch=max_batch)


def _check_greedy(engine, target):
    reqs = [(p, sm.greedy(m)) for p, m in zip(PROMPTS, MAX_TOKENS, strict=True)]
    seqs = engine.generate(reqs)
    for (p, sp), s in zip(reqs, seqs, strict=True):
        assert s.output_ids == sm.reference(target, p, sp), p
    assert engine.pool.num_free == engine.pool.num_pages
    assert engine.draft.pool.num_free == engine.draft.pool.num_pages
    return seqs


@pytest.mark.parametrize("draft", ["random head", "noisy draft"])
def test_useless_drafts_turn_off_with_measured_costs_and_output_stays(draft, llama):
    """A random EAGLE head and a draft model with a random LM head, timed for real: drafting
    turns off (most sequence steps undrafted), the output is target-only greedy, and the
    draft's state caught up right where it drafted again (EAGLE: the head's invariant)."""
    engine = _engine("head" if draft == "random head" else "draft", llama, AdaptiveDrafting())
    seqs = _check_greedy(engine, llama)
    st = engine.stats
    assert st.switched_off >= 1 and st.undrafted_steps > 2 * st.verify_steps > 0
    assert engine.policy.ratio(len(PROMPTS)) >= 1.05
    if draft == "random head":
        assert all(s.draft_len + len(s.draft_feats) == s.num_tokens - 1 for s in seqs)
    assert not engine.policy.seqs  # forgotten as they ended


def test_a_good_draft_stays_on(llama):
    """The full model as its own draft (every draft accepted, 4 tokens per step) against r =
    1.5: no sequence is ever kept from drafting."""
    full = self_draft(llama, llama.config.num_layers)
    cfg = AdaptiveDrafting(cost_ratio=1.5)
    dspec = DraftSpec(full, full.make_pool(64, 4, role="draft"), 3, policy=cfg)
    engine = SpecEngine(llama, llama.make_pool(64, 4), dspec)
    _check_greedy(engine, llama)
    assert engine.stats.acceptance_rate == 1.0
    assert engine.stats.switched_off == engine.stats.undrafted_steps == 0


@pytest.mark.parametrize("kind", ["head", "draft model"])
def test_drafting_off_then_on_again_stays_lossless(kind, llama):
    """Drafts that are wrong for the first 12 tokens of every sequence, then the target's own
    next tokens: the sequences switch off, probe, and draft again; the draft catches up the
    undrafted run (the draft model its KV, the head its features) and the output is
    target-only greedy."""
    cfg = AdaptiveDrafting(probe_interval=2, probe_steps=2, cost_ratio=1.5)
    engine = _engine("head" if kind == "head" else "draft", llama, cfg)
    pairs = list(zip(PROMPTS, MAX_TOKENS, strict=True))
    ref = {tuple(p): sm.reference(llama, p, sm.greedy(m)) for p, m in pairs}
    propose, caught_up = engine._propose, []

    def late_oracle(seqs, ks):
        caught_up.extend(engine._pending(s) for s, k in zip(seqs, ks, strict=True) if k)
        drafts, qs = propose(seqs, ks)  # runs the draft (its KV and state as usual)
        for s, d in zip(seqs, drafts, strict=True):
            at = len(s.output_ids)
            good = (ref[tuple(s.prompt_ids)][at:] + [0] * len(d))[: len(d)]
            d[:] = good if at >= 12 else [(t + 1) % 256 for t in good]
        return drafts, qs

    engine._propose = late_oracle
    seqs = _check_greedy(engine, llama)
    st = engine.stats
    assert st.switched_off >= 3 and engine.policy.stats.probes >= 3
    assert max(caught_up) > 4  # drafting resumed after an undrafted run
    long = [s for s in seqs if len(s.output_ids) >= 33]
    assert all(s.num_accepted >= 12 for s in long)  # on again, and accepted
    if kind == "head":
        assert all(s.draft_len + len(s.draft_feats) == s.num_tokens - 1 for s in seqs)


def test_an_undrafted_head_step_samples_from_the_target(llama):
    """Temperature 1 with a head the server has switched off (its mean under r): the token an
    undrafted step emits follows the target's softmax at that position."""
    from test_spec_sampling import CHI2_999, _chi2

    from backends.runtime.spec import probs

    n, prompt, first = 1500, rm.random_prompt(6, seed=5), 7
    cfg = AdaptiveDrafting(cost_ratio=1.5)
    engine = _engine("head", llama, cfg, k=2, pages=n, page_size=8, max_batch=n)
    for _ in range(8):
        engine.policy.server.add(1.0)  # the server's mean: drafting does not pay
    params = [SamplingParams(temperature=1.0, top_k=5, seed=i, max_tokens=3, ignore_eos=True)
              for i in range(n)]  # fmt: skip
    t = add_same_prompt(engine, prompt, first, params)
    engine.step()  # admission: reports `first`
    out = engine.step()
    assert engine.stats.proposed == 0 and engine.stats.undrafted_steps == n
    counts = torch.bincount(torch.tensor([t[0] for t in out.new_tokens.values()]), minlength=256)
    assert _chi2(counts.float(), probs(t[None], params[0])[0].cpu()) < CHI2_999[4]


def test_bad_policy_parameters_are_refused():
    for kw in (
        {"probe_interval": 0},
        {"window": 1.5},
        {"min_ratio": 0.9},
        {"cost_ratio": 0.5},
        {"margin": -0.1},
    ):
        with pytest.raises(ValueError):
            AdaptiveDrafting(**kw)


def test_the_stage_parameters_reach_the_policy_and_the_metrics(llama):
    """decode's spec_adaptive / spec_probe_interval make the DraftSpec policy; the stats the
    metrics read say how often drafting was held back."""
    from backends.stages.draft import draft_policy, spec_stats
    from backends.stages.params import StageParams, parse_params

    assert draft_policy(StageParams(spec_probe_interval=7)) == AdaptiveDrafting(probe_interval=7)
    assert draft_policy(parse_params({"spec_adaptive": "false"})) is None
    with pytest.raises(ValueError, match="spec_probe_interval"):
        parse_params({"spec_probe_interval": "0"})
    engine = _engine("draft", llama, draft_policy(StageParams()))
    _check_greedy(engine, llama)
    st = spec_stats(engine)
    assert st["spec_undrafted_steps"] == engine.stats.undrafted_steps > 0
    assert st["spec_switched_off"] == engine.stats.switched_off > 0
