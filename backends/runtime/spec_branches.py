"""Several draft chains per sequence, verified side by side (``DraftSpec.branches``).

With ``branches = W > 1`` an EAGLE head proposes up to W chains for a greedy sequence: its
first draft's, and one for each of the next ``W - 1`` most likely first tokens, which the head
then continues greedily (each cut by the step's :class:`~.spec.DraftChain` like the first). The
target verifies every chain in the same forward: the first over ``[last token, chain]``, each
other over its chain alone, as an input whose root is the first (``SeqInput.root``): the last
token's KV, computed once, is copied into the alternative's pages in every layer before it
attends. So W chains of k drafts are ``1 + W k`` rows, not ``W (k + 1)``. At most one chain
starts with the target's own choice; the sequence keeps that one (else the first), with the
first row's logits and feature before its own, so the emitted tokens are the greedy ones still.

A chain other than the first writes its KV, the head's and the target's, into a tail of pages of
its own: a copy of the page that holds the last token's position (the positions before it are
the sequence's, shared) and fresh pages after it. When the target keeps an alternative, its tail
replaces the sequence's pages from there on (the displaced ones are freed). The head's KV past
the real features is a prediction that the next catch-up overwrites, so the alternatives' head
pages are freed as soon as the chains are drafted. Every tail is freed by the end of the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .kv_pool import KVPool
from .paged import SeqInput
from .sampler import argmax_rows
from .sequence import Sequence


def fork_tail(pool: KVPool, pages: list[int], first: int, last: int):
    """A page table for writing positions ``[first, last]`` beside ``pages``: ``pages``' blocks
    before ``first``'s, then fresh pages, the first a copy of ``first``'s block (its earlier
    positions). -> (page table, the fresh pages), or None when the pool has too few free."""
    ps = pool.page_size
    b0, b1 = first // ps, last // ps
    if pool.num_free < b1 - b0 + 1:
        return None
    tail = pool.alloc(b1 - b0 + 1)
    if first % ps:
        pool.copy_page(pages[b0], tail[0])
    return pages[:b0] + tail, tail


def can_branch(seq: Sequence) -> bool:
    """Greedy without penalties: the target's choice at the first position is the argmax of its
    raw logits, the same in every chain's row."""
    return seq.params.greedy and not seq.params.has_penalties


@dataclass
class Chain:
    """One draft chain of sequence ``i`` (the step's index): its drafts, their distributions
    (a sampled chain), its index in the step's DraftChain, the head's page table it writes
    through and the head's output it continues from."""

    i: int
    drafts: list[int]
    c: int
    head_pages: list[int]
    feature: torch.Tensor | None = None
    qs: list = field(default_factory=list)
    tail: list[int] | None = None  # the target's pages of its own (verify)


class Branches:
    """One step's alternative chains and every page they hold (``close`` frees them)."""

    def __init__(self, width: int, head_pool: KVPool, pool: KVPool):
        self.width, self.head_pool, self.pool = width, head_pool, pool
        self.alts: dict[int, list[Chain]] = {}
        self._head_tails: list[list[int]] = []
        self._tails: list[list[int]] = []
        self.kept = 0

    def spawn(
        self, seq: Sequence, main: Chain, row: torch.Tensor, k: int, chain, dist=None
    ) -> list[Chain]:
        """Alternatives to ``main``, whose first draft the head chose from ``row`` [V] (``dist``:
        its distribution, as ``chain.drafted`` returned it): the next best first tokens, each a
        chain of up to ``k`` drafts. The head continues them at the positions from
        ``seq.draft_len`` on, through tails of its own."""
        top = row.topk(min(self.width, row.numel()))
        picks = [t for v, t in zip(top.values.tolist(), top.indices.tolist(), strict=True)
                 if t != main.drafts[0] and v != float("-inf")]  # fmt: skip
        new: list[Chain] = []
        for t in picks[: self.width - 1]:
            head_pages = seq.draft_pages
            if k > 1:  # the head is fed its drafts but the last
                fork = fork_tail(self.head_pool, seq.draft_pages, seq.draft_len,
                                 seq.draft_len + k - 2)  # fmt: skip
                if fork is None:
                    break
                head_pages, tail = fork
                self._head_tails.append(tail)
            alt = Chain(main.i, [t], chain.add(k, main.i), head_pages, main.feature)
            dist = chain.drafted(alt.c, seq, row, alt.drafts, alt.qs, dist)
            new.append(alt)
        if new:
            self.alts[main.i] = new
        return new

    def keep_best(self, main: Chain, chain) -> None:
        """Cut ``main``'s sequence's chains to its ``max_drafts`` most confident drafts
        (:meth:`~.spec.DraftChain.keep_best`); an alternative left with none is dropped."""
        if not chain.max_drafts:
            return
        alts = self.alts.get(main.i, [])
        chain.keep_best([main] + alts)
        alts[:] = [a for a in alts if a.drafts]
        if not alts:
            self.alts.pop(main.i, None)

    def drafted(self) -> None:
        """The chains are drafted: the head's tails are no longer read."""
        tails, self._head_tails = self._head_tails, []
        for t in tails:
            self.head_pool.free(t)

    def verify_inputs(self, seqs: list[Sequence]) -> list[SeqInput]:
        """The target's inputs of the alternatives (each over its own tail, rooted at its
        sequence's input: sequence i's is the forward's i-th), in ``alts``' order; an
        alternative the pool has no pages for is dropped."""
        inputs = []
        for i, alts in self.alts.items():
            s = seqs[i]
            start = s.num_tokens - 1
            for alt in list(alts):
                fork = fork_tail(self.pool, s.pages, start, start + len(alt.drafts))
                if fork is None:
                    alts.remove(alt)
                    continue
                pages, alt.tail = fork
                self._tails.append(alt.tail)
                inputs.append(SeqInput(alt.drafts, start + 1, pages, root=i))
        return inputs

    def keep(self, seqs: list[Sequence], drafts: list[list[int]], logits: list, feats: list,
             alt_logits: list, alt_feats: list) -> None:  # fmt: skip
        """Per sequence with alternatives, the chain whose first draft is the target's choice
        (argmax of the last token's row, the sequence's first) goes into ``drafts[i]``, its
        rows after that first one into ``logits[i]`` and ``feats[i]``, and its tail into the
        sequence's pages."""
        at = 0
        for i, alts in self.alts.items():
            rows = range(at, at + len(alts))
            at += len(alts)
            best = int(argmax_rows(logits[i][:1])[0])
            if drafts[i][0] == best:
                continue
            for alt, r in zip(alts, rows, strict=True):
                if alt.drafts[0] != best:
                    continue
                drafts[i][:] = alt.drafts
                logits[i] = torch.cat([logits[i][:1], alt_logits[r]])
                feats[i] = torch.cat([feats[i][:1], alt_feats[r]])
                s, b0 = seqs[i], (seqs[i].num_tokens - 1) // self.pool.page_size
                displaced = s.pages[b0 : b0 + len(alt.tail)]
                s.pages[b0 : b0 + len(alt.tail)] = alt.tail
                self._tails.remove(alt.tail)
                self._tails.append(displaced)
                self.kept += 1
                break

    def close(self) -> None:
        """Free every tail still held (the ones not kept, and the pages kept ones displaced)."""
        self.drafted()
        tails, self._tails = self._tails, []
        for t in tails:
            self.pool.free(t)
