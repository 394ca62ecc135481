"""Speculative decoding with an EAGLE head (:mod:`.eagle`): :class:`SpecEngine` whose proposals
come from the head, fed by the target's own features; verify and acceptance are SpecEngine's
(the same lossless rules, penalties, logprobs and stop handling).

Per sequence, with ``n`` its tokens: the target's features are known for positions
``[0, n - 1)`` (every token but the last, which was never fed to the target). The head has
consumed ``[0, draft_len)`` of them (its KV); ``draft_feats`` holds the rest, so always
``draft_len + len(draft_feats) == n - 1``:

* prefill: one target forward gives the logits and every prompt feature; the head runs the pairs
  ``(f_i, x_{i+1})`` for ``i < P - 1`` and keeps ``f_{P-1}`` for later (the first token is not
  sampled yet);
* propose: the head first catches up the pairs of ``draft_feats`` (their tokens are the
  sequence's next ones); its last output gives ``d_1``; then each further draft is a pair
  (the head's own output, the previous draft) at the next position. Those positions hold
  predicted features, so ``draft_len`` does not count them: the next catch-up overwrites them;
* verify: the target forward over ``[x_{n-1}, d_1 .. d_k]`` also returns their features; with
  ``m`` drafts accepted, ``f_{n-1} .. f_{n-1+m}`` are real and join ``draft_feats``.

A sequence without head state (``draft_feats`` None) is verified one token at a time.
With ``DraftSpec.branches > 1``, a greedy sequence's head also continues the next best first
drafts, each a chain verified beside the first (:mod:`.spec_branches`).
"""

from __future__ import annotations

import torch

from .eagle import EagleHead
from .paged import SeqInput
from .sequence import Sequence
from .spec import DraftChain, DraftSpec, SpecEngine, _penalised_rows
from .spec_branches import Branches, Chain, can_branch


class EagleSpecEngine(SpecEngine):
    """A :class:`SpecEngine` whose ``draft.runner`` is an :class:`EagleHead`."""

    # the head reads the target's features of every prompt position, which a cached prefix
    # never computes (caching the head's KV and the last feature per block would lift this)
    prefix_cache_refusal = "an EAGLE head needs the target's features of the whole prompt"
    plain_when_undrafted = False  # the head's features come from the verify forward only
    branching = True  # DraftSpec.branches (spec_branches)

    def __init__(self, runner, pool, draft: DraftSpec, *args, **kwargs):
        if not isinstance(draft.runner, EagleHead):
            raise TypeError("EagleSpecEngine needs an EagleHead draft (use spec_engine())")
        if draft.branches > 1 and (not runner.local_pools or pool.window is not None):
            raise ValueError(
                "spec_branches > 1 is not supported with tensor parallelism or a sliding-window"
                " pool: a chain's pages are copied in place"
            )
        super().__init__(runner, pool, draft, *args, **kwargs)
        self._verified: dict[str, torch.Tensor] = {}
        self._branches: Branches | None = None  # the step's alternative chains

    def _adopt_draft_pages(self, seq: Sequence, draft_pages, feature=None) -> None:
        """Prefilled elsewhere: the head's KV of the prompt pairs (positions [0, P - 1)) and
        the target's feature of the last prompt position; without both, no drafting."""
        super()._adopt_draft_pages(seq, draft_pages)
        if draft_pages is not None and feature is not None:
            H = self.runner.config.hidden_size
            if tuple(feature.shape) != (H,):
                raise ValueError(f"draft_feature must be [{H}], got {tuple(feature.shape)}")
            seq.draft_len = len(seq.prompt_ids) - 1
            seq.draft_feats = feature.to(self.runner.device)[None]

    def _pending(self, seq: Sequence) -> int:
        return len(seq.draft_feats) if seq.draft_feats is not None else 0

    # ---- compute -----------------------------------------------------------------------------
    def _prefill_logits(self, seqs: list[Sequence]) -> torch.Tensor:
        inputs = [self._seq_input(s, s.prompt_ids, 0) for s in seqs]
        logits, feats = self.runner.forward(self.pool, inputs, last_only=True, features=True)
        run = [(s, f) for s, f in zip(seqs, feats, strict=True) if len(s.prompt_ids) > 1]
        if run:  # pairs (f_i, x_{i+1}) of the prompt, i < P - 1
            head_in = [SeqInput(s.prompt_ids[1:], 0, s.draft_pages) for s, _ in run]
            self.draft.runner.forward_head(
                self.draft.pool, head_in, [f[:-1] for _, f in run], logits=False
            )
        for s, f in zip(seqs, feats, strict=True):
            s.draft_len, s.draft_feats = len(s.prompt_ids) - 1, f[-1:].clone()
        return torch.cat(logits)

    def _propose(self, seqs: list[Sequence], ks: list[int]) -> tuple[list, list]:
        drafts: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = [
            i
            for i, k in enumerate(ks)
            if k > 0 and seqs[i].draft_feats is not None and len(seqs[i].draft_feats)
        ]
        inputs, feats = [], []
        for i in active:  # catch up the real features
            s = seqs[i]
            n = len(s.draft_feats)
            tokens = (s.prompt_ids + s.output_ids)[s.draft_len + 1 : s.draft_len + 1 + n]
            inputs.append(SeqInput(tokens, s.draft_len, s.draft_pages))
            feats.append(s.draft_feats)
            s.draft_len, s.draft_feats = s.draft_len + n, s.draft_feats[:0]
        chain = DraftChain(ks, self.draft.min_confidence, self.draft.max_drafts)
        mains = rows = [Chain(i, drafts[i], i, seqs[i].draft_pages, qs=qs[i]) for i in active]
        branches = self._branches = Branches(self.draft.branches, self.draft.pool, self.pool)
        j = 0
        try:
            while rows:
                logits, outs = self.draft.runner.forward_head(self.draft.pool, inputs, feats)
                pen = _penalised_rows([seqs[r.i] for r in rows], logits, [r.drafts for r in rows])
                spawned = []
                for r, row, g in zip(rows, pen, outs, strict=True):
                    s, r.feature = seqs[r.i], g  # the head's own predicted feature
                    r.drafts.append(self._propose_one(s, row[-1], r.qs))
                    dist = chain.drafted(r.c, s, row[-1], r.drafts, r.qs)
                    if j == 0 and branches.width > 1 and can_branch(s):
                        spawned += branches.spawn(s, r, row[-1], ks[r.i], chain, dist)
                j += 1
                rows = [r for r in rows + spawned if chain.wants(r.c, j)]
                inputs = [
                    SeqInput([r.drafts[-1]], seqs[r.i].draft_len + j - 1, r.head_pages)
                    for r in rows
                ]
                feats = [r.feature for r in rows]
        except Exception:
            branches.close()
            self._branches = None
            raise
        for r in mains:
            branches.keep_best(r, chain)
        branches.drafted()
        return drafts, qs

    def _verify_logits(
        self, seqs: list[Sequence], inputs: list[SeqInput], drafts: list[list[int]]
    ) -> list:
        branches, self._branches = self._branches, None
        try:
            more = branches.verify_inputs(seqs) if branches is not None else []
            logits, feats = self.runner.forward(self.pool, inputs + more, features=True)
            n = len(inputs)
            logits, feats, alt_logits, alt_feats = logits[:n], feats[:n], logits[n:], feats[n:]
            if more:
                branches.keep(seqs, drafts, logits, feats, alt_logits, alt_feats)
                self.stats.branch_kept += branches.kept
        finally:
            if branches is not None:
                branches.close()
        self._verified = {s.seq_id: f for s, f in zip(seqs, feats, strict=True)}
        return logits

    def _accept(self, seq: Sequence, tokens, m: int, proposed: int, out, logprobs=None) -> None:
        f = self._verified.pop(seq.seq_id, None)
        if f is not None and seq.draft_feats is not None:  # f_{n-1} .. f_{n-1+m} are real
            seq.draft_feats = torch.cat([seq.draft_feats, f[: m + 1]])
        super()._accept(seq, tokens, m, proposed, out, logprobs)

    def _decode(self, decoding: list[Sequence], out) -> None:
        saved = [s.draft_feats for s in decoding]  # a failed step leaves them as they were
        try:
            super()._decode(decoding, out)
        except Exception:
            for s, f in zip(decoding, saved, strict=True):
                s.draft_feats = f
            raise


def spec_engine(runner, pool, draft: DraftSpec, *args, **kwargs) -> SpecEngine:
    """The speculative engine for ``draft``: :class:`EagleSpecEngine` for a head, else
    :class:`SpecEngine` (a draft model)."""
    cls = EagleSpecEngine if isinstance(draft.runner, EagleHead) else SpecEngine
    return cls(runner, pool, draft, *args, **kwargs)
