"""Speculative rejection sampling keeps the target's distribution; seeded runs reproduce."""

from __future__ import annotations

import runtime_models as rm
import spec_models as sm
import torch

from backends.runtime.sampling_params import SamplingParams
from backends.runtime.spec import accept_sampled, probs

CHI2_999 = {4: 18.47, 5: 20.52}  # chi-square 99.9% quantiles by degrees of freedom


def _chi2(counts: torch.Tensor, p: torch.Tensor) -> float:
    """Pearson statistic of counts against p over p's support (mass outside it: inf)."""
    n = counts.sum()
    if counts[p == 0].sum() > 0:
        return float("inf")
    e = n * p[p > 0]
    return float(((counts[p > 0] - e) ** 2 / e).sum())


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def test_accept_sampled_preserves_target_distribution():
    """Synthetic p, q (k = 2): the 1st, 2nd and bonus tokens follow p, not q."""
    p = torch.tensor(
        [
            [0.40, 0.30, 0.15, 0.10, 0.05, 0.00],
            [0.05, 0.05, 0.10, 0.20, 0.25, 0.35],
            [0.10, 0.10, 0.50, 0.10, 0.10, 0.10],
        ]
    )
    q = torch.tensor([[0.05, 0.10, 0.15, 0.20, 0.20, 0.30], [0.30, 0.25, 0.20, 0.10, 0.10, 0.05]])
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(3, 6)
    accepted = 0
    n = 12000
    for _ in range(n):
        drafts = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(2)]
        tokens, m = accept_sampled(p, q, drafts, g)
        assert len(tokens) == m + 1 and tokens[:m] == drafts[:m]
        accepted += m
        for j, t in enumerate(tokens):
            counts[j, t] += 1
    # token j+1 is emitted only when token j was an accepted draft; given that, it follows p[j+1]
    for j in range(3):
        assert _chi2(counts[j], p[j]) < CHI2_999[5 if j else 4]
        assert _tv(counts[j] / counts[j].sum(), p[j]) < 0.03
        assert _tv(counts[j] / counts[j].sum(), q[min(j, 1)]) > 0.3  # q would be caught
    # acceptance of the first draft is sum(min(p, q)) = 1 - TV(p, q)
    first = counts[1].sum() / n
    assert abs(float(first) - float(torch.minimum(p[0], q[0]).sum())) < 0.02
    assert 0 < accepted < 2 * n


def test_engine_first_speculated_token_follows_target(llama):
    """Many seeded requests with the same prompt and first token: the first token the spec step
    emits is distributed as the target's softmax (temperature 1, top-k 5) at that position."""
    prompt, first = rm.random_prompt(6, seed=5), 7
    params = [
        SamplingParams(temperature=1.0, top_k=5, seed=i, max_tokens=3, ignore_eos=True)
        for i in range(1500)
    ]
    draft = sm.noisy_draft(llama, 0.5)
    engine = sm.spec_engine(
        llama, draft, k=2, pages=1500, page_size=8, draft_page_size=8, max_batch=1500
    )
    # prompt KV once per pool, then the same bytes into every request's page (page i)
    t_logits, d_logits = sm.add_same_prompt(engine, prompt, first, params)
    engine.step()  # admission: reports `first`
    out = engine.step()  # one speculative step (k clamped to 1 by max_tokens = 3)
    counts = torch.bincount(torch.tensor([t[0] for t in out.new_tokens.values()]), minlength=256)
    p = probs(t_logits[-1:], params[0])[0].cpu()
    q = probs(d_logits[-1:], params[0])[0].cpu()
    assert _tv(p, q) > 0.3  # the draft is far from the target, so a wrong rule shows
    assert 0.2 < engine.stats.acceptance_rate < 0.8  # both accept and reject paths ran
    assert _chi2(counts.float(), p) < CHI2_999[4]
    assert _tv(counts.float() / counts.sum(), q) > 0.25
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.num_free == 1500 and engine.draft.pool.num_free == 1500


def _sampled_run(llama, seeds):
    engine = sm.spec_engine(llama, sm.noisy_draft(llama, 0.3), k=3)
    reqs = [
        (
            rm.random_prompt(5 + i, seed=i),
            SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_tokens=16, ignore_eos=True),
        )
        for i, s in enumerate(seeds)
    ]
    reqs.append((rm.random_prompt(7, seed=99), sm.greedy(16)))  # greedy in the same batch
    return [s.output_ids for s in engine.generate(reqs)]


def test_seeded_sampling_is_reproducible(llama):
    a = _sampled_run(llama, [1, 2, 3])
    assert a == _sampled_run(llama, [1, 2, 3])
    b = _sampled_run(llama, [4, 5, 6])
    assert a[:3] != b[:3] and a[3] == b[3]  # other seeds differ; the greedy one does not
    assert a[3] == sm.reference(llama, rm.random_prompt(7, seed=99), sm.greedy(16))
