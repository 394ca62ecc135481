"""Draft chains cut short where the draft's own confidence runs out (DraftSpec.min_confidence,
decode's ``spec_min_confidence``): fewer drafts per verify step, and still lossless: greedy
output equals target-only token for token (a self-draft and an EAGLE head), and with sampling
the token a step emits after an accepted draft follows the target's distribution, whether or
not the chain was cut before it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import runtime_models as rm
import spec_models as sm
import torch
from eagle_heads import random_head
from test_spec_sampling import CHI2_999, _chi2, _tv

from backends.runtime.paged import SeqInput
from backends.runtime.sampling_params import SamplingParams
from backends.runtime.sequence import FinishReason, Sequence
from backends.runtime.spec import DraftChain, DraftSpec, load_draft, probs, self_draft
from backends.runtime.spec_eagle import spec_engine
from backends.stages.params import StageParams

PROMPTS = [rm.random_prompt(n, seed=n) for n in (1, 4, 9, 14, 6)]
MAX_TOKENS = [20, 9, 16, 3, 12]


def _logits(p: list[float]) -> torch.Tensor:
    return torch.tensor(p).log()


def test_chain_ends_with_the_draft_that_takes_the_product_under_the_threshold():
    chain = DraftChain([3, 3, 2], 0.3)
    greedy = sm.greedy(8)
    chain.drafted(0, _seq(greedy), _logits([0.9, 0.1]), [0], [])  # 0.9
    chain.drafted(1, _seq(greedy), _logits([0.2, 0.8]), [0], [])  # 0.2: cut after it
    assert chain.wants(0, 1) and not chain.wants(1, 1) and chain.wants(2, 1)
    chain.drafted(0, _seq(greedy), _logits([0.5, 0.5]), [0, 1], [])  # 0.45
    chain.drafted(0, _seq(greedy), _logits([0.6, 0.4]), [0, 1, 0], [])  # 0.27: cut, at k anyway
    assert chain.wants(0, 2) and not chain.wants(0, 3)
    # sampled: the probability of the drawn token under the distribution it was drawn from
    sampled = _seq(SamplingParams(temperature=1.0, max_tokens=8))
    chain.drafted(2, sampled, _logits([0.99, 0.01]), [1], [torch.tensor([0.25, 0.75])])
    assert chain.wants(2, 1)
    chain.drafted(2, sampled, _logits([0.99, 0.01]), [1, 0], [torch.tensor([0.3, 0.7])] * 2)
    assert chain.ks == [3, 1, 2]  # 0.75 * 0.3 < 0.3 at the second draft, its k anyway
    off = DraftChain([3], 0.0)
    off.drafted(0, _seq(greedy), _logits([0.5, 0.5]), [0], [])
    assert off.wants(0, 2) and not off.wants(0, 3)


def test_max_drafts_keeps_a_sequences_most_confident_drafts_over_its_chains():
    """A sequence's chains (its own and an alternative) share its max_drafts: a chain stops once
    its next draft could not rank among them, the cut keeps a prefix of each, the shallower
    first among equal confidences; another sequence's drafts do not count."""
    greedy = _seq(sm.greedy(8))
    chain = DraftChain([3, 3], 0.0, max_drafts=3)
    alt = chain.add(3, 0)  # sequence 0's alternative
    chain.drafted(0, greedy, _logits([0.6, 0.4]), [0], [])  # 0.6
    chain.drafted(alt, greedy, _logits([0.6, 0.4]), [1], [])  # 0.4
    chain.drafted(1, greedy, _logits([0.9, 0.1]), [0], [])  # sequence 1: 0.9
    assert chain.wants(0, 1) and chain.wants(alt, 1) and chain.wants(1, 1)  # 2 of 3
    chain.drafted(0, greedy, _logits([0.5, 0.5]), [0, 0], [])  # 0.3: the third draft
    assert not chain.wants(0, 2)  # at most 0.3: no better than its own third best
    assert chain.wants(alt, 1)  # 0.4 > 0.3: its next draft may rank
    chain.drafted(alt, greedy, _logits([0.7, 0.3]), [1, 0], [])  # 0.28
    assert not chain.wants(alt, 2) and chain.wants(1, 1)
    main = SimpleNamespace(c=0, drafts=[0, 0], qs=[])
    other = SimpleNamespace(c=alt, drafts=[1, 0], qs=[])
    chain.keep_best([main, other])  # 0.6, 0.4, 0.3 (0.28 goes)
    assert (main.drafts, other.drafts) == ([0, 0], [1])
    chain.max_drafts = 2
    chain.keep_best([main, other])
    assert (main.drafts, other.drafts) == ([0], [1])
    tie = DraftChain([2], 0.0, max_drafts=2)
    tie_alt = tie.add(2, 0)
    tie.drafted(0, greedy, _logits([0.5, 0.5]), [0], [])
    tie.drafted(0, greedy, _logits([1.0, 0.0]), [0, 0], [])  # 0.5 again, one deeper
    tie.drafted(tie_alt, greedy, _logits([0.5, 0.5]), [1], [])  # 0.5
    a, b = SimpleNamespace(c=0, drafts=[0, 0], qs=[]), SimpleNamespace(c=tie_alt, drafts=[1], qs=[])
    tie.keep_best([a, b])
    assert (a.drafts, b.drafts) == ([0], [1])  # the alternative's first, not the deeper one
    free = DraftChain([3], 0.0)  # no limit: nothing cut
    free.drafted(0, greedy, _logits([0.1, 0.9]), [0], [])
    free.keep_best([SimpleNamespace(c=0, drafts=[0], qs=[])])
    assert free.wants(0, 1)


def test_max_drafts_is_checked(llama):
    with pytest.raises(ValueError, match="max_drafts must be an integer >= 0"):
        sm.spec_engine(llama, self_draft(llama, 1), max_drafts=-1)
    with pytest.raises(ValueError, match="spec_max_drafts must be >= 0"):
        StageParams(spec_max_drafts=-1)


def _seq(params: SamplingParams) -> Sequence:
    return Sequence("s", [1, 2], params)


def test_min_confidence_is_checked(llama):
    with pytest.raises(ValueError, match="min_confidence"):
        sm.spec_engine(llama, self_draft(llama, 1), min_confidence=1.0)


def _check_greedy(engine, target):
    reqs = [(p, sm.greedy(m)) for p, m in zip(PROMPTS, MAX_TOKENS, strict=True)]
    seqs = engine.generate(reqs)
    for (p, sp), s in zip(reqs, seqs, strict=True):
        assert s.output_ids == sm.reference(target, p, sp), p
        assert s.finish_reason == FinishReason.LENGTH
    assert engine.pool.num_free == engine.pool.num_pages
    assert engine.draft.pool.num_free == engine.draft.pool.num_pages
    return seqs


@pytest.mark.parametrize("draft", ["self-draft", "eagle"])
def test_cut_chains_keep_greedy_output(draft, llama):
    """k = 4 with and without a cut: the same tokens; the cut proposes fewer drafts a step."""
    stats = {}
    for c in (0.0, 0.5):
        if draft == "eagle":
            head = load_draft(llama, path=random_head(rm.checkpoint("llama")))
            dspec = DraftSpec(head, head.make_pool(64, 4, role="draft"), 4, min_confidence=c)
            engine = spec_engine(llama, llama.make_pool(64, 4), dspec)
        else:
            engine = sm.spec_engine(llama, self_draft(llama, 1), k=4, min_confidence=c)
        seqs = _check_greedy(engine, llama)
        if draft == "eagle":  # the head's feature invariant holds after cut chains
            assert all(s.draft_len + len(s.draft_feats) == s.num_tokens - 1 for s in seqs)
        stats[c] = engine.stats
    assert stats[0.0].drafts_per_step > 3  # k = 4, clamped only near max_tokens
    assert 1.0 <= stats[0.5].drafts_per_step < stats[0.0].drafts_per_step


def test_sampled_token_after_an_accepted_draft_follows_the_target(llama):
    """Temperature 1, k = 2, a noisy draft, the cut set so that about half of the chains end
    after their first draft (which ones depends on the draft token drawn): given the first
    emitted token (an accepted draft), the second one still follows the target's softmax at
    its position, with the chain cut or not."""
    n, prompt, first = 1500, rm.random_prompt(6, seed=5), 7
    params = [SamplingParams(temperature=1.0, top_k=5, seed=i, max_tokens=4, ignore_eos=True)
              for i in range(n)]  # fmt: skip
    draft = sm.noisy_draft(llama, 0.5)
    [d_logits] = draft.forward(draft.make_pool(4, 8), [SeqInput(prompt + [first], 0, [0])])
    q1 = probs(d_logits[-1:], params[0])[0]
    cut = float(q1[q1 > 0].median())  # chains of the likelier half of first drafts go on
    engine = sm.spec_engine(llama, draft, k=2, pages=n, page_size=16, draft_page_size=16,
                            max_batch=n, min_confidence=cut)  # fmt: skip
    t_logits, _ = sm.add_same_prompt(engine, prompt, first, params)
    engine.step()  # admission: reports `first`
    out = engine.step()  # one speculative step, k = 2
    assert 1.0 < engine.stats.drafts_per_step < 2.0  # some chains were cut, some not
    runs = list(out.new_tokens.values())
    p1 = probs(t_logits[-1:], params[0])[0].cpu()
    firsts = torch.bincount(torch.tensor([r[0] for r in runs]), minlength=256)
    assert _chi2(firsts.float(), p1) < CHI2_999[4]
    # the second token after the most frequent first token that was an accepted draft
    two = [r for r in runs if len(r) >= 2]
    t1 = int(torch.bincount(torch.tensor([r[0] for r in two])).argmax())
    seconds = torch.bincount(torch.tensor([r[1] for r in two if r[0] == t1]), minlength=256)
    assert seconds.sum() > 300
    [t2_logits] = llama.forward(
        llama.make_pool(4, 8), [SeqInput(prompt + [first, t1], 0, [0])], last_only=True
    )
    p2 = probs(t2_logits, params[0])[0].cpu()
    [d2_logits] = draft.forward(
        draft.make_pool(4, 8), [SeqInput(prompt + [first, t1], 0, [0])], last_only=True
    )
    assert _tv(p2, probs(d2_logits, params[0])[0].cpu()) > 0.2  # a wrong rule would show
    assert _chi2(seconds.float(), p2) < CHI2_999[4]
