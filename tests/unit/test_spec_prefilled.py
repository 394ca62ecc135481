"""Decode with prompt KV (target AND draft) prepared elsewhere, as the disaggregated path does."""

from __future__ import annotations

import pytest
import runtime_models as rm
import spec_models as sm
import torch

from backends.runtime.kv_pool import KVPool

PROMPTS = [rm.random_prompt(n, seed=10 + n) for n in (5, 11, 3, 17)]
MAX_TOKENS = 14


def _page_dim(pool: KVPool) -> int:
    return 2 if pool.layout.attn == "gqa" else 1  # [L][2][pages..] or [L][pages..]


def _copy_pages(src: KVPool, src_pages, dst: KVPool, dst_pages) -> None:
    """Stands in for kvtransfer: the pages' bytes, all layers, into the decode pool."""
    assert src.layout.signature() == dst.layout.signature()
    dim = _page_dim(src)
    data = src.tensor.index_select(dim, _ids(src_pages, src))
    dst.tensor.index_copy_(dim, _ids(dst_pages, dst), data)


def _ids(pages, pool: KVPool) -> torch.Tensor:
    return torch.tensor(pages, device=pool.tensor.device)


def _prefill_elsewhere(target, draft, engine, prompt, sid, params, with_draft=True):
    """A separate 'prefill server' with pools of identical layout; returns the decode Sequence."""
    t_src = target.make_pool(engine.pool.num_pages, engine.pool.page_size)
    d_src = draft.make_pool(engine.draft.pool.num_pages, engine.draft.pool.page_size, "draft")
    t_src.shuffle_free_list(seed=len(prompt))
    t_pages = t_src.alloc(t_src.pages_needed(len(prompt)))
    d_pages = d_src.alloc(d_src.pages_needed(len(prompt)))
    first = int(target.prefill(t_src, prompt, t_pages).argmax())
    draft.prefill(d_src, prompt, d_pages)  # the draft's prompt KV, computed at prefill
    dst = engine.pool.alloc(len(t_pages))  # decode side: destination pages
    _copy_pages(t_src, t_pages, engine.pool, dst)
    if not with_draft:
        return engine.add_prefilled(sid, prompt, dst, first, params)
    d_dst = engine.draft.pool.alloc(len(d_pages))
    _copy_pages(d_src, d_pages, engine.draft.pool, d_dst)
    assert torch.equal(  # the draft KV bytes at decode equal the ones computed at prefill
        engine.draft.pool.tensor.index_select(_page_dim(d_src), _ids(d_dst, d_src)),
        d_src.tensor.index_select(_page_dim(d_src), _ids(d_pages, d_src)),
    )
    return engine.add_prefilled(sid, prompt, dst, first, params, draft_pages=d_dst)


@pytest.mark.parametrize("case", ["llama+noisy", "mla+gqa"])
def test_prefilled_draft_pages_match_colocated(case, llama, mla):
    if case == "llama+noisy":
        target, draft = llama, sm.noisy_draft(llama, 0.3)
    else:
        target, draft = mla, llama
    params = sm.greedy(MAX_TOKENS)
    colo = sm.spec_engine(target, draft, k=3, draft_page_size=8)
    colo_seqs = colo.generate([(p, params) for p in PROMPTS])
    disagg = sm.spec_engine(target, draft, k=3, draft_page_size=8)
    disagg.draft.pool.shuffle_free_list(seed=5)
    seqs = [
        _prefill_elsewhere(target, draft, disagg, p, f"d{i}", params) for i, p in enumerate(PROMPTS)
    ]
    while disagg.has_unfinished():
        disagg.step()
    for c, d, p in zip(colo_seqs, seqs, PROMPTS, strict=True):
        assert d.output_ids == c.output_ids == sm.reference(target, p, params)
        assert (d.num_accepted, d.num_verify_steps) == (c.num_accepted, c.num_verify_steps)
    assert disagg.stats.as_dict() == colo.stats.as_dict()
    assert disagg.pool.num_free == disagg.pool.num_pages
    assert disagg.draft.pool.num_free == disagg.draft.pool.num_pages


def test_missing_draft_kv_is_recomputed(llama):
    """No draft pages (the draft KV did not arrive): the draft catches up; same tokens."""
    draft = sm.noisy_draft(llama, 0.3)
    engine = sm.spec_engine(llama, draft, k=3)
    params = sm.greedy(MAX_TOKENS)
    seqs = [
        _prefill_elsewhere(llama, draft, engine, p, f"m{i}", params, with_draft=i % 2 == 0)
        for i, p in enumerate(PROMPTS)
    ]
    while engine.has_unfinished():
        engine.step()
    for s, p in zip(seqs, PROMPTS, strict=True):
        assert s.output_ids == sm.reference(llama, p, params)
    assert engine.stats.accepted > 0
    assert engine.pool.num_free == 64 and engine.draft.pool.num_free == 64


def test_draft_pages_too_few_is_refused(llama):
    engine = sm.spec_engine(llama, llama, k=2)
    pages = engine.pool.alloc(3)
    with pytest.raises(ValueError, match="draft pages"):
        engine.add_prefilled(
            "x", rm.random_prompt(10, seed=1), pages, 5, sm.greedy(4), draft_pages=[0]
        )
