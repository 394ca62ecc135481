"""Helpers for the speculative decoding tests: engines, drafts, target-only references."""

from __future__ import annotations

import copy

import torch

from backends.runtime.engine import LLMEngine
from backends.runtime.paged import SeqInput
from backends.runtime.runner import ModelRunner
from backends.runtime.sampling_params import SamplingParams
from backends.runtime.spec import DraftSpec, SpecEngine


def noisy_draft(target: ModelRunner, scale: float, seed: int = 0) -> ModelRunner:
    """The target with Gaussian noise on its LM head: a draft with partial acceptance."""
    g = torch.Generator().manual_seed(seed)
    head = target.model.lm_head
    draft = copy.copy(target)
    draft.model = copy.copy(target.model)
    noise = torch.randn(head.shape, generator=g).to(head.device)
    draft.model.lm_head = head + scale * head.std() * noise
    return draft


def spec_engine(
    target: ModelRunner,
    draft: ModelRunner,
    k: int = 3,
    pages: int = 64,
    page_size: int = 4,
    draft_page_size: int = 4,
    max_batch: int = 16,
    spec_max_batch: int = 0,
    min_confidence: float = 0.0,
    max_drafts: int = 0,
) -> SpecEngine:
    dpool = draft.make_pool(pages, draft_page_size, role="draft")
    pool = target.make_pool(pages, page_size)
    dspec = DraftSpec(draft, dpool, k, spec_max_batch, min_confidence=min_confidence,
                      max_drafts=max_drafts)  # fmt: skip
    return SpecEngine(target, pool, dspec, max_batch=max_batch)


def add_same_prompt(engine: SpecEngine, prompt: list[int], first: int, params: list):
    """One prefilled request per ``params`` to a draft-model engine (page i of both pools
    each), all with ``prompt`` and first token ``first``, as PD hands them over: the target's
    and the draft's KV of the prompt computed once into page 0 and copied to every page.
    -> (the target's, the draft's logits after ``first``) [1, V] each."""
    ids = prompt + [first]
    [t_logits] = engine.runner.forward(engine.pool, [SeqInput(ids, 0, [0])])
    [d_logits] = engine.draft.runner.forward(engine.draft.pool, [SeqInput(ids, 0, [0])])
    engine.pool.tensor[:, :, 1:] = engine.pool.tensor[:, :, :1]
    engine.draft.pool.tensor[:, :, 1:] = engine.draft.pool.tensor[:, :, :1]
    pages, dpages = engine.pool.alloc(len(params)), engine.draft.pool.alloc(len(params))
    for i, sp in enumerate(params):
        engine.add_prefilled(f"s{i}", prompt, [pages[i]], first, sp, draft_pages=[dpages[i]])
    return t_logits[-1:], d_logits[-1:]


_REFERENCES: dict = {}


def reference(target: ModelRunner, prompt: list[int], params: SamplingParams) -> list[int]:
    """Target-only greedy output of the plain engine (itself checked against transformers)."""
    key = (id(target), tuple(prompt), params)
    if key not in _REFERENCES:
        engine = LLMEngine(target, target.make_pool(64, 4), max_batch=1)
        _REFERENCES[key] = (target, engine.generate([(prompt, params)])[0].output_ids)
    return list(_REFERENCES[key][1])  # the key holds the runner alive: its id stays unique


def greedy(max_tokens: int, ignore_eos: bool = True) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
