"""Several draft chains per sequence (backends/runtime/spec_branches.py, DraftSpec.branches):
the output stays the target-only greedy output when an alternative chain is kept (its pages
become the sequence's), every page a chain took is free again, and where a chain cannot run
(no free pages, sampling, penalties, a draft model) the engine serves one chain."""

from __future__ import annotations

import pytest
import runtime_models as rm
import spec_models as sm
import torch
from eagle_heads import random_head, trained_head

from backends.runtime.loader import load_runner
from backends.runtime.paged import SeqInput
from backends.runtime.sampling_params import SamplingParams
from backends.runtime.spec import DraftSpec, load_draft
from backends.runtime.spec_branches import Branches, fork_tail
from backends.runtime.spec_eagle import EagleSpecEngine, spec_engine
from backends.stages.params import StageParams

PROMPTS = [rm.random_prompt(n, seed=n) for n in (1, 4, 9, 14, 6)]
MAX_TOKENS = [20, 9, 16, 3, 12]


def _prefilled(target, context: list[int], num_pages: int = 16):
    pool = target.make_pool(num_pages, 4)
    pages = pool.alloc(-(-(len(context) + 4) // 4))
    target.prefill(pool, context, pages)
    return pool, pages


def _engine(target, head_dir: str, branches: int, pages: int = 64, k: int = 3,
            max_drafts: int = 0):  # fmt: skip
    head = load_draft(target, path=head_dir)
    dspec = DraftSpec(head, head.make_pool(pages, 4, role="draft"), k, branches=branches,
                      max_drafts=max_drafts)  # fmt: skip
    return spec_engine(target, target.make_pool(pages, 4), dspec)


def _second_choice_first(engine: EagleSpecEngine) -> None:
    """The first chain of every greedy sequence starts from the head's second choice, so the
    head's own first choice is an alternative: kept whenever the head was right."""
    propose_one = engine._propose_one

    def second(seq, logits, q):
        if seq.params.greedy and not engine._second_done.get(seq.seq_id):
            engine._second_done[seq.seq_id] = True
            return int(logits.topk(2).indices[1])
        return propose_one(seq, logits, q)

    engine._second_done = {}
    engine._propose_one = second
    step = engine.step

    def each_step():
        engine._second_done.clear()  # the first draft of each step
        return step()

    engine.step = each_step


@pytest.mark.parametrize("branches", [2, 4])
def test_kept_alternatives_give_the_target_only_output(llama, branches):
    engine = _engine(llama, trained_head(rm.checkpoint("llama")), branches)
    _second_choice_first(engine)
    reqs = [(p, sm.greedy(m)) for p, m in zip(PROMPTS, MAX_TOKENS, strict=True)]
    seqs = engine.generate(reqs)
    for (p, sp), s in zip(reqs, seqs, strict=True):
        assert s.output_ids == sm.reference(llama, p, sp), p
        assert s.draft_len + len(s.draft_feats) == s.num_tokens - 1  # the head's invariant
    # kept alternatives, whose first draft was accepted: their KV became the sequences'
    assert engine.stats.branch_kept > 0
    assert engine.pool.num_free == 64 and engine.draft.pool.num_free == 64


@pytest.mark.parametrize("max_drafts", [0, 5])
def test_max_drafts_bounds_what_a_sequence_verifies_a_step(llama, max_drafts):
    """With four chains of three drafts, a sequence's verify rows (its input and the inputs
    rooted at it) are at most 1 + max_drafts a step; the output stays target-only's and every
    page comes back. Without the limit the same steps verify more."""
    engine = _engine(llama, trained_head(rm.checkpoint("llama")), 4, max_drafts=max_drafts)
    _second_choice_first(engine)
    most = []
    forward = engine.runner.forward

    def counted(pool, inputs, *args, **kwargs):
        if kwargs.get("features") and not kwargs.get("last_only"):  # a verify
            rows: dict[int, int] = {}
            for i, x in enumerate(inputs):
                key = i if x.root is None else x.root
                rows[key] = rows.get(key, 0) + len(x.token_ids)
            most.append(max(rows.values()))
        return forward(pool, inputs, *args, **kwargs)

    engine.runner.forward = counted
    try:
        reqs = [(p, sm.greedy(m)) for p, m in zip(PROMPTS, MAX_TOKENS, strict=True)]
        for (p, sp), s in zip(reqs, engine.generate(reqs), strict=True):
            assert s.output_ids == sm.reference(llama, p, sp), p
    finally:
        del engine.runner.forward
    assert most and (max(most) == 1 + max_drafts if max_drafts else max(most) > 6)
    assert engine.pool.num_free == 64 and engine.draft.pool.num_free == 64


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
def test_branches_on_gqa_and_mla_targets_are_lossless(kind, llama, mla):
    target = llama if kind == "llama" else mla
    engine = _engine(target, random_head(rm.checkpoint(kind), 64), 3)
    _second_choice_first(engine)
    reqs = [(p, sm.greedy(m)) for p, m in zip(PROMPTS, MAX_TOKENS, strict=True)]
    for (p, sp), s in zip(reqs, engine.generate(reqs), strict=True):
        assert s.output_ids == sm.reference(target, p, sp), p
    assert engine.pool.num_free == 64 and engine.draft.pool.num_free == 64


def test_no_free_pages_serves_one_chain(llama):
    """A pool with no page to spare: no alternative runs, nothing fails, nothing leaks."""
    prompt, m = PROMPTS[2], 16
    pages = -(-(len(prompt) + m) // 4)
    engine = _engine(llama, trained_head(rm.checkpoint("llama")), 4, pages=pages)
    (s,) = engine.generate([(prompt, sm.greedy(m))])
    assert s.output_ids == sm.reference(llama, prompt, sm.greedy(m))
    assert engine.stats.branch_kept == 0 and engine.stats.verify_steps > 0
    assert engine.pool.num_free == pages and engine.draft.pool.num_free == pages


def test_sampled_and_penalised_sequences_run_one_chain(llama, monkeypatch):
    engine = _engine(llama, trained_head(rm.checkpoint("llama")), 3)
    spawned = []
    spawn = Branches.spawn

    def spy(self, seq, main, row, k, chain, dist=None):
        spawned.append(seq.seq_id)
        return spawn(self, seq, main, row, k, chain, dist)

    monkeypatch.setattr(Branches, "spawn", spy)
    sampled = SamplingParams(max_tokens=8, temperature=0.8, seed=1, ignore_eos=True)
    penalised = SamplingParams(max_tokens=8, repetition_penalty=1.3, ignore_eos=True)
    seqs = engine.generate([(PROMPTS[1], sampled), (PROMPTS[2], penalised),
                            (PROMPTS[4], sm.greedy(8))])  # fmt: skip
    ids = [s.seq_id for s in seqs]
    assert ids[0] not in spawned and ids[1] not in spawned and ids[2] in spawned
    assert seqs[1].output_ids == sm.reference(llama, PROMPTS[2], penalised)
    assert engine.pool.num_free == 64 and engine.draft.pool.num_free == 64


def test_branches_need_an_eagle_head_and_a_count(llama):
    draft = load_draft(llama, num_layers=1)
    dspec = DraftSpec(draft, draft.make_pool(16, 4, role="draft"), 2, branches=2)
    with pytest.raises(ValueError, match="need an EAGLE head"):
        spec_engine(llama, llama.make_pool(16, 4), dspec)
    with pytest.raises(ValueError, match="branches must be an integer >= 1"):
        DraftSpec(draft, draft.make_pool(16, 4, role="draft"), 2, branches=0)
    with pytest.raises(ValueError, match="spec_branches must be an integer >= 1"):
        StageParams(spec_branches=0)


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
def test_copy_page_copies_every_layer_of_one_page(kind, llama, mla):
    target = llama if kind == "llama" else mla
    pool = target.make_pool(6, 4)
    pool.tensor.copy_(torch.randn(pool.tensor.shape).to(pool.tensor.dtype))
    before = pool.tensor.clone()
    src, dst = pool.alloc(2)
    pool.copy_page(src, dst)
    axis = 2 if pool.layout.attn == "gqa" else 1
    assert torch.equal(pool.tensor.select(axis, dst), before.select(axis, src))
    others = [p for p in range(6) if p != dst]
    idx = torch.tensor(others)
    assert torch.equal(pool.tensor.index_select(axis, idx), before.index_select(axis, idx))
    with pytest.raises(ValueError, match="not exclusively held"):
        pool.copy_page(src, 5)  # a free page


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3", "llama fp8"])
def test_an_input_with_a_root_attends_to_the_roots_first_tokens(kind, llama, mla):
    """Chains fed alone after their root's first tokens (KV computed once, by the root input)
    give the logits of those tokens and the chain fed as a sequence of its own; their tail
    pages hold the shared tokens' KV, as the root's page does (an fp8 pool: its bytes)."""
    target = {"llama": llama, "deepseek_v3": mla}.get(kind)
    if target is None:
        target = load_runner(rm.checkpoint("llama"), kv_cache_dtype="float8_e4m3fn")
    prompt = rm.random_prompt(10, seed=3)
    context, last, start = prompt[:-1], prompt[-1], len(prompt) - 1  # start: mid-page
    main = [5, 6, 7]
    alts = [([last], [8, 9]), ([last, main[0]], [10])]  # (the root's tokens shared, the chain)
    ref_pool, ref_pages = _prefilled(target, context)
    want = [target.forward(ref_pool, [SeqInput(shared + c, start, ref_pages)])[0]
            for shared, c in alts]  # fmt: skip
    pool, pages = _prefilled(target, context)
    tails = [fork_tail(pool, pages, start, start + len(sh) + len(c) - 1) for sh, c in alts]
    root_in = SeqInput([last] + main, start, pages)
    rooted = [SeqInput(c, start + len(sh), t, root=0)
              for (sh, c), (t, _) in zip(alts, tails, strict=True)]  # fmt: skip
    got = target.forward(pool, [root_in, *rooted])
    torch.testing.assert_close(got[0][:1], want[0][:1], rtol=1e-4, atol=1e-4)
    for (shared, _), w, g in zip(alts, want, got[1:], strict=True):
        torch.testing.assert_close(g, w[len(shared) :], rtol=1e-4, atol=1e-4)
    axis = 2 if pool.layout.attn == "gqa" else 1  # [layers, (2,) pages, page_size, ...]

    kv = pool.tensor.view(torch.uint8) if pool.tensor.element_size() == 1 else pool.tensor

    def slot(pos: int, table: list[int]) -> torch.Tensor:  # every layer's KV of one position
        return kv.select(axis, table[pos // 4]).select(axis, pos % 4)

    for (shared, _), (table, _) in zip(alts, tails, strict=True):
        for pos in range(start, start + len(shared)):
            assert torch.equal(slot(pos, table), slot(pos, pages))
    table = tails[0][0]
    bad = [SeqInput([8], start + 1, table, root=1), SeqInput([8], start, table, root=0)]
    for b, why in zip(bad, ["not another input", "must follow one of"], strict=True):
        with pytest.raises(ValueError, match=why):
            target.forward(pool, [root_in, b])


def test_a_tensor_parallel_runner_refuses_an_input_with_a_root():
    """Its ranks get the inputs over the wire, without the copies: refused, not run wrong."""
    from backends.runtime.tp.runner import _wire

    assert len(_wire([SeqInput([1, 2], 4, [0, 1])])) == 1
    with pytest.raises(ValueError, match="no input with a root"):
        _wire([SeqInput([1, 2], 4, [0, 1]), SeqInput([3], 5, [0, 2], root=0)])


def test_a_pool_with_recurrent_states_refuses_an_input_with_a_root():
    """Only KV is copied to a rooted input: a recurrent layer's state would miss the root's
    tokens, so the forward is refused."""
    target = load_runner(rm.checkpoint("nemotron_h"))
    pool = target.make_pool(16, 4)
    slots = [pool.states.alloc(), pool.states.alloc()]
    seqs = [SeqInput([5, 6], 0, pool.alloc(1), slots[0]),
            SeqInput([7], 1, pool.alloc(1), slots[1], root=0)]  # fmt: skip
    with pytest.raises(ValueError, match="recurrent states"):
        target.forward(pool, seqs)
