"""Sampler behaviour: greedy, top-k/top-p filtering, seeded reproducibility; self-draft load."""

from __future__ import annotations

import pytest
import runtime_models as rm
import torch

from backends.runtime.loader import load_runner
from backends.runtime.sampler import argmax_rows, generator, sample
from backends.runtime.sampling_params import SamplingParams


def test_greedy_and_top_k_1_pick_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=1, seed=3)] * 2
    gens = [generator(p) for p in params]
    assert sample(logits, params, gens) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("vocab", [49152, 151936, 50257, 2048])
def test_argmax_rows_is_argmax_with_its_ties_and_nans(vocab):
    """The chunked argmax picks what torch's does: the first maximum, across chunk borders
    too, the first NaN, and index 0 of an all -inf row; one row, a strided view, and a
    vocabulary no chunk divides (50257, torch's own)."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(7, vocab, generator=g)
    x[1, [5, vocab - 3]] = 50.0  # a tie far apart: the first
    x[2, [1023, 1024]] = 50.0  # a tie across a chunk border
    x[3, [vocab // 2, 7]] = float("nan")  # the first NaN wins
    x[4] = float("-inf")
    x[5, vocab - 1] = 1e9  # the very last column
    for rows in (x, x[5:6], x.t().contiguous().t()):
        assert argmax_rows(rows).tolist() == rows.argmax(-1).tolist()


def test_top_p_keeps_only_the_nucleus():
    logits = torch.tensor([[5.0, 4.0, -5.0, -5.0, -6.0]])
    p = SamplingParams(temperature=1.0, top_p=0.5)
    picks = {sample(logits, [p], [torch.Generator().manual_seed(s)])[0] for s in range(50)}
    assert picks == {0}
    p = SamplingParams(temperature=1.0, top_p=0.9)
    picks = {sample(logits, [p], [torch.Generator().manual_seed(s)])[0] for s in range(50)}
    assert picks == {0, 1}


def test_seeded_sampling_reproducible_and_varied():
    logits = torch.zeros(1, 1000)
    draws = []
    for seed in (1, 1, 2):
        p = SamplingParams(temperature=0.8, seed=seed)
        g = generator(p)
        draws.append([sample(logits, [p], [g])[0] for _ in range(5)])
    assert draws[0] == draws[1] and draws[0] != draws[2]


def test_self_draft_is_first_layers_of_target():
    path = rm.checkpoint("llama")
    draft = load_runner(path, num_layers=2)
    target = load_runner(path)
    assert draft.config.num_layers == 2 and len(draft.model.layers) == 2
    assert torch.equal(draft.model.lm_head, target.model.lm_head)
    pool = draft.make_pool(4, 4, role="draft")
    assert pool.layout.num_layers == 2 and pool.layout.role == "draft"
    prompt = rm.random_prompt(7, seed=0)
    logits = draft.prefill(pool, prompt, pool.alloc(2))
    tpool = target.make_pool(4, 4)
    tlogits = target.prefill(tpool, prompt, tpool.alloc(2), groups=[(0, 2), (2, 4)])
    assert torch.equal(pool.tensor[:2], tpool.tensor[:2])  # same KV for the shared layers
    assert not torch.allclose(logits, tlogits)
