"""Speculative decoding: a draft model proposes k tokens, the target verifies them in one forward.

:class:`SpecEngine` is an :class:`~backends.runtime.engine.LLMEngine` whose every sequence
holds pages in two pools: the target's and the draft's (each with its own layout, e.g. an MLA
target and a GQA draft). Each :meth:`~backends.runtime.engine.LLMEngine.step` advances every
running sequence by one to ``k + 1`` tokens:

1. **propose**: the draft runs up to ``k`` batched forwards (its first forward also catches up
   the tokens whose draft KV is missing: the previous step's correction / bonus token, a fully
   accepted last draft token, or a whole prompt whose draft KV never arrived); a sequence's
   chain ends early where the draft is unsure of it (:class:`DraftChain`);
2. **verify**: one batched target forward over ``[last token, d_1 .. d_k]`` at positions
   ``[n - 1, n + k)`` gives ``k + 1`` distributions;
3. **accept**: greedy keeps the longest prefix equal to the target's argmax plus the target's
   token at the first mismatch (or the bonus token); sampling uses speculative rejection
   sampling (accept ``d_j`` with ``min(1, p/q)``, else resample from ``norm(max(0, p - q))``;
   bonus from ``p``), with temperature / top-k / top-p applied identically to ``p`` and ``q``
   and every random draw taken from the request's seeded generator.

Penalties, stop strings, stop_token_ids and logprobs give exactly what the plain engine gives:
the target's logits at verify position ``j`` are penalised with the history ``output_ids +
drafts[:j]`` (greedy compares the drafts with their argmax; rejection sampling uses the
penalised ``p``), and the draft penalises its own proposals the same way, so ``q`` is the
distribution it drew from. Accepted tokens go through ``Sequence.append`` one at a time, so the
stop rules (and the sequence's TextState) see exactly the emitted tokens. An emitted token's
logprob is taken from the verify forward's raw target logits at its position.

Rejected positions are rolled back by length only: their KV stays in the pages as stale data
that the next write overwrites. ``k`` is clamped per sequence to ``max_tokens - emitted - 1`` (no
write goes past the plain engine's page reservation or ``max_context``), to 0 in a step of
more than ``DraftSpec.max_batch`` sequences (where verifying k + 1 rows each costs more), and to
0 for the sequences an adaptive policy (``DraftSpec.policy``, :mod:`.draft_policy`) keeps from
drafting because their drafts do not pay. A step in which nobody drafts is the target's plain
decode step (CUDA graphs included); the draft catches up the tokens it missed the next time it
drafts. ``SpecStats.verify_steps`` counts the steps that verified at least one draft.

Usage (decode stage)::

    draft = load_draft(target, num_layers=K)            # or load_draft(target, path=DIR)
    engine = SpecEngine(target, target.make_pool(n, ps), DraftSpec(draft, draft_pool, k))
    engine.add_prefilled(sid, prompt, pages, first, params, draft_pages=dpages)
    out = engine.step()                                 # StepOutput, 1..k+1 tokens per sequence

with ``draft_pool = draft.make_pool(n, ps, role="draft")``, whose ``dpages`` the prefill side
filled with ``draft.prefill(draft_pool, prompt, pages)``.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch

from .draft_policy import AdaptiveDrafting, DraftPolicy
from .eagle import EagleHead, head_config
from .engine import LLMEngine, StepOutput
from .kv_pool import KVPool
from .loader import load_runner
from .paged import SeqInput
from .runner import ModelRunner
from .sampler import _filter, argmax_rows, penalize, scaled, token_logprobs
from .sampling_params import SamplingParams, TokenLogprob
from .sequence import Sequence

# ---- draft models ------------------------------------------------------------------------------


def self_draft(target: ModelRunner, num_layers: int) -> ModelRunner:
    """The target's first ``num_layers`` layers + its final norm and LM head, sharing weights."""
    config = target.config.truncated(num_layers)
    model = copy.copy(target.model)  # shallow: every tensor is the target's own
    model.cfg = config
    model.layers = target.model.layers[:num_layers]
    draft = ModelRunner(config, model, target.dtype, str(target.device), graphs=True)
    if target.kv_scale_log2:  # fp8: the shared layers' scales
        comps = len(target.kv_scale_log2) // target.config.num_layers
        draft.set_kv_cache(target.kv_dtype, target.kv_scale_log2[: num_layers * comps])
    return draft


def load_draft(
    target: ModelRunner,
    path: str | None = None,
    num_layers: int | None = None,
    tensor_parallel_size: int = 1,
) -> ModelRunner:
    """A draft for ``target``: the checkpoint at ``path`` (over ``tensor_parallel_size`` ranks
    of its own, from the target's device on), or a ``num_layers`` self-draft."""
    if (path is None) == (num_layers is None):
        raise ValueError("give exactly one of a draft checkpoint path or self-draft num_layers")
    check_speculable(target, "target")
    if num_layers is not None:
        return self_draft(target, num_layers)
    if head_config(path) is not None:  # an EAGLE head (spec_eagle.spec_engine runs it)
        return EagleHead.load_head(path, target)
    kv = "auto" if target.kv_dtype == target.dtype else target.kv_dtype  # fp8: its own scales
    draft = load_runner(
        path,
        dtype=target.dtype,
        device=str(target.device),
        tensor_parallel_size=tensor_parallel_size,
        kv_cache_dtype=kv,
    )
    check_compatible(target, draft)
    return draft


def check_speculable(runner: ModelRunner, role: str) -> None:
    """Refuse a model with recurrent layers (gated DeltaNet, Mamba2) as target or draft:
    verification rolls rejected tokens back by length, which a recurrent state cannot be (it
    would keep them folded in, silently): speculation would need a state per draft position."""
    if runner.config.has_recurrent_state:
        raise ValueError(
            f"speculative decoding is not supported with a {role} model that has recurrent "
            f"layers ({runner.config.architecture}): its state cannot be rolled back past "
            f"rejected draft tokens; serve it without spec"
        )


def check_compatible(target: ModelRunner, draft: ModelRunner) -> None:
    check_speculable(target, "target")
    check_speculable(draft, "draft")
    t, d = target.config, draft.config
    if t.vocab_size != d.vocab_size:
        raise ValueError(
            f"draft vocabulary ({d.vocab_size} tokens) differs from the target's "
            f"({t.vocab_size}): the draft must share the target's tokenizer"
        )
    if draft.device != target.device:
        raise ValueError(f"draft on {draft.device} but target on {target.device}")


@dataclass(frozen=True)
class DraftSpec:
    """The draft side of a :class:`SpecEngine`: its runner, its own KV pool, k, the batch size
    above which a step drafts nothing (verifying one token per sequence; 0: no limit), the
    adaptive policy's parameters (None: every sequence drafts whenever it can), and the chain's
    stopping confidence: a sequence's chain ends early once the product of the draft's
    probabilities of its drafts so far falls under ``min_confidence`` (0: always k drafts);
    ``branches``: chains per greedy sequence, the first one's and the next best first drafts'
    (an EAGLE head only: :mod:`.spec_branches`); ``max_drafts``: the drafts a sequence's chains
    verify at most in a step, its most confident ones (0: no limit; :class:`DraftChain`)."""

    runner: ModelRunner
    pool: KVPool
    num_spec_tokens: int = 4
    max_batch: int = 0
    policy: AdaptiveDrafting | None = None
    min_confidence: float = 0.0
    branches: int = 1
    max_drafts: int = 0

    def __post_init__(self) -> None:
        for name, low in (("num_spec_tokens", 1), ("max_batch", 0), ("branches", 1),
                          ("max_drafts", 0)):  # fmt: skip
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
        if not 0.0 <= self.min_confidence < 1.0:
            raise ValueError(f"min_confidence must be in [0, 1), got {self.min_confidence!r}")
        self.runner._check_pool(self.pool)


@dataclass
class SpecStats:
    verify_steps: int = 0  # (sequence, target forward that verified >= 1 draft) pairs
    proposed: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens the target accepted
    undrafted_steps: int = 0  # (sequence, step) pairs the adaptive policy kept from drafting
    switched_off: int = 0  # times the policy stopped a sequence's drafting (or started it off)
    branch_kept: int = 0  # verify steps that kept another chain than the first (spec_branches)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify step: accepted drafts + the correction / bonus token."""
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0

    @property
    def drafts_per_step(self) -> float:
        """Drafts proposed per verify step (k, or fewer where chains ended early)."""
        return self.proposed / self.verify_steps if self.verify_steps else 0.0

    def as_dict(self) -> dict:
        return {
            "verify_steps": self.verify_steps,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "drafts_per_step": self.drafts_per_step,
            "undrafted_steps": self.undrafted_steps,
            "switched_off": self.switched_off,
            "branch_kept": self.branch_kept,
        }


# ---- acceptance rules --------------------------------------------------------------------------


def probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [n, V] -> sampling distribution [n, V] (temperature, top-k, top-p applied)."""
    rows = [_filter(scaled(r, params.temperature), params.top_k, params.top_p) for r in logits]
    return torch.stack(rows).softmax(-1)


def _draw(p: torch.Tensor, g: torch.Generator | None) -> int:
    return int(torch.multinomial(p, 1, generator=g))


def _uniform(device: torch.device, g: torch.Generator | None) -> float:
    return float(torch.rand((), device=device, generator=g))


def accept_greedy(target_logits: torch.Tensor, drafts: list[int]) -> tuple[list[int], int]:
    """target_logits [k+1, V] -> (emitted tokens, number of accepted drafts)."""
    best = argmax_rows(target_logits).tolist()
    m = 0
    while m < len(drafts) and drafts[m] == best[m]:
        m += 1
    return drafts[:m] + [best[m]], m


def accept_sampled(
    p: torch.Tensor, q: torch.Tensor, drafts: list[int], g: torch.Generator | None
) -> tuple[list[int], int]:
    """Speculative rejection sampling. p: target [k+1, V]; q: draft [k, V] the drafts came from.

    The emitted tokens are distributed exactly as sampling them one by one from ``p``.
    """
    out: list[int] = []
    for j, d in enumerate(drafts):
        if _uniform(p.device, g) * float(q[j, d]) < float(p[j, d]):  # prob min(1, p/q)
            out.append(d)
            continue
        residual = (p[j] - q[j]).clamp_min(0)
        total = float(residual.sum())
        out.append(_draw(residual / total if total > 0 else p[j], g))
        return out, j
    out.append(_draw(p[len(drafts)], g))  # all accepted: bonus token
    return out, len(drafts)


def _penalised_rows(
    seqs: list[Sequence], logits: list[torch.Tensor], drafts: list[list[int]]
) -> list[torch.Tensor]:
    """Per sequence i, ``logits[i]`` [n_i, V] with its penalties applied; its rows score the
    tokens after the last n_i prefixes of ``d = drafts[i]``, so row j's history is
    ``output_ids + d[:len(d) + 1 - n_i + j]`` (verify: n_i = len(d) + 1, row j after d[:j];
    a draft step: n_i = 1, after all of d). One :func:`penalize` over all rows; the logits
    come back unchanged (no copy) when no sequence has penalties."""
    if not any(s.params.has_penalties for s in seqs):
        return logits
    params, hist = [], []
    for s, lg, d in zip(seqs, logits, drafts, strict=True):
        params += [s.params] * len(lg)
        base = len(d) + 1 - len(lg)
        hist += [(s.prompt_ids, s.output_ids + d[: base + j]) for j in range(len(lg))]
    rows = penalize(torch.cat(logits), params, hist)
    return list(rows.split([len(lg) for lg in logits]))


def _emitted_logprobs(
    seqs: list[Sequence], logits: list[torch.Tensor], done: list[tuple[int, list[int], int]]
) -> list[list[TokenLogprob | None] | None]:
    """Per accepted run (index i, emitted tokens, _), the emitted tokens' logprobs from the raw
    verify logits ``logits[i][j]`` (None for a sequence that did not ask); one
    :func:`token_logprobs` over all of them."""
    want = [(i, t) for i, t, _ in done if seqs[i].params.logprobs is not None]
    if not want:
        return [None] * len(done)
    rows = torch.cat([logits[i][: len(t)] for i, t in want])
    flat = token_logprobs(
        rows, [x for _, t in want for x in t], [seqs[i].params for i, t in want for _ in t]
    )
    per: dict[int, list[TokenLogprob | None]] = {}
    at = 0
    for i, t in want:
        per[i], at = flat[at : at + len(t)], at + len(t)
    return [per.get(i) for i, _, _ in done]


class DraftChain:
    """One step's draft lengths: ``ks[i]`` for chain i (sequence i's own, or an alternative
    :meth:`add` joins to a sequence), cut short where the draft's own confidence runs out: once
    the product of the draft's probabilities of its drafts so far is under ``min_confidence``
    (:class:`DraftSpec`), the chain ends with that draft. With ``max_drafts``, a sequence keeps
    its ``max_drafts`` most confident drafts over all its chains: a chain stops once its next
    draft could not be among them, and :meth:`keep_best` cuts the rest. The cuts read the
    draft's side only (its distributions, its draws), so verification stays lossless."""

    def __init__(self, ks: list[int], min_confidence: float, max_drafts: int = 0):
        self.ks, self.min_confidence, self.max_drafts = list(ks), min_confidence, max_drafts
        self.trail: list[list[float]] = [[] for _ in ks]  # chain -> confidence after each draft
        self.sequence = list(range(len(ks)))  # chain -> its sequence
        self.of_sequence: dict[int, list[float]] = {}  # sequence -> its drafts' (max_drafts)

    def drafted(
        self, i: int, seq: Sequence, row: torch.Tensor, drafts: list[int], q: list, dist=None
    ) -> torch.Tensor | None:
        """Chain i proposed ``drafts[-1]`` from the logits ``row`` [V] (sampled: drawn from
        ``q[-1]``, the distribution the verify's rejection rule uses). -> the distribution it
        read (None: no cut needs one), for ``dist`` of another chain drafted from ``row``."""
        if not self.min_confidence and not self.max_drafts:
            return None
        if dist is None:
            dist = row.float().softmax(-1) if seq.params.greedy else q[-1]
        trail = self.trail[i]
        trail.append((trail[-1] if trail else 1.0) * float(dist[drafts[-1]]))
        if trail[-1] < self.min_confidence:
            self.ks[i] = min(self.ks[i], len(drafts))
        if self.max_drafts:
            self.of_sequence.setdefault(self.sequence[i], []).append(trail[-1])
        return dist

    def add(self, k: int, sequence: int) -> int:
        """One more chain of up to ``k`` drafts for ``sequence`` (an alternative,
        :mod:`.spec_branches`): its index."""
        self.ks.append(k)
        self.trail.append([])
        self.sequence.append(sequence)
        return len(self.ks) - 1

    def wants(self, i: int, j: int) -> bool:
        """Whether chain i drafts a token after its first ``j``."""
        if self.ks[i] <= j:
            return False
        drafted = self.of_sequence.get(self.sequence[i], [])
        if not self.max_drafts or len(drafted) < self.max_drafts:
            return True
        # its next draft is at most as confident as its last, and ranks after an equal one
        return self.trail[i][-1] > sorted(drafted, reverse=True)[self.max_drafts - 1]

    def keep_best(self, chains: list) -> None:
        """Cut one sequence's ``chains`` (each with ``c``, its index here, and its ``drafts``
        and ``qs``) to the sequence's ``max_drafts`` most confident drafts, the shallower first
        among equals: each keeps a prefix, since confidence never rises along a chain."""
        if not self.max_drafts:
            return
        ranked = sorted(
            (-conf, depth, n)
            for n, ch in enumerate(chains)
            for depth, conf in enumerate(self.trail[ch.c][: len(ch.drafts)])
        )
        keep = [0] * len(chains)
        for _, depth, n in ranked[: self.max_drafts]:
            keep[n] = max(keep[n], depth + 1)
        for ch, n in zip(chains, keep, strict=True):
            del ch.drafts[n:], ch.qs[n:]


# ---- engine ------------------------------------------------------------------------------------


class SpecEngine(LLMEngine):
    """LLMEngine with a draft model; same API plus ``draft_pages`` on :meth:`add_prefilled`.

    With a prefix cache only the target's pool is cached: the target computes the prompt from
    its cached length on, the draft the whole prompt into its own pages (its KV is not cached).
    Verify writes rejected drafts' KV only at positions ``>= num_tokens - 1``, past every block
    the engine publishes, so cached pages hold accepted tokens' KV only."""

    # the target's plain step can replace a step nobody drafts in (an EAGLE head needs the
    # features that only the verify forward returns)
    plain_when_undrafted = True
    # DraftSpec.branches > 1 is served (an EAGLE head's engine)
    branching = False

    def __init__(
        self,
        runner: ModelRunner,
        pool: KVPool,
        draft: DraftSpec,
        max_batch: int = 16,
        max_context: int | None = None,
        tokenizer=None,
        prefix_cache=None,
    ):
        check_compatible(runner, draft.runner)
        limit = min(
            runner.config.max_position_embeddings, draft.runner.config.max_position_embeddings
        )
        if max_context is None:
            max_context = limit
        elif isinstance(max_context, int) and max_context > limit:
            raise ValueError(
                f"max_context {max_context} exceeds the draft or target max_position_embeddings "
                f"({limit})"
            )
        if draft.branches > 1 and not self.branching:
            raise ValueError(
                f"spec_branches {draft.branches}: several chains per sequence need an EAGLE head"
            )
        super().__init__(
            runner, pool, max_batch, max_context, tokenizer=tokenizer, prefix_cache=prefix_cache
        )
        self.draft = draft
        self.stats = SpecStats()
        self.policy = DraftPolicy(draft.policy) if draft.policy is not None else None

    # ---- requests ----------------------------------------------------------------------------
    def _validate(self, seq_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        super()._validate(seq_id, prompt_ids, params)
        dpool = self.draft.pool
        need = dpool.pages_needed(len(prompt_ids) + params.max_tokens - 1)
        if need > dpool.num_pages:
            raise ValueError(
                f"request needs {need} draft KV pages but the draft pool only has {dpool.num_pages}"
            )

    # add_prefilled (inherited) with ``draft_pages``: the engine owns and frees them (allocated
    # from the draft pool by the caller). Without them (e.g. the draft KV failed to arrive) the
    # draft recomputes the prompt's KV locally on the first step; same output, only slower.
    def _check_draft_pages(self, prompt_tokens: int, draft_pages: list[int] | None) -> None:
        if draft_pages is not None:
            self.draft.pool.check_holds(prompt_tokens, draft_pages, "draft ")

    def _adopt_draft_pages(self, seq: Sequence, draft_pages, feature=None) -> None:
        if draft_pages is not None:
            seq.draft_pages = list(draft_pages)
            seq.draft_len = len(seq.prompt_ids)

    # ---- pages -------------------------------------------------------------------------------
    def _step_tokens(self) -> int:
        return self.draft.num_spec_tokens + 1  # a verify: the last token and k drafts

    def _draft_extra(self, seq: Sequence) -> int:
        return self.draft.pool.pages_needed(seq.max_kv_tokens) - len(seq.draft_pages)

    def _can_reserve(self, seq: Sequence) -> bool:
        return super()._can_reserve(seq) and self._draft_extra(seq) <= self.draft.pool.num_free

    def _reserve(self, seq: Sequence) -> None:
        super()._reserve(seq)
        extra = self._draft_extra(seq)
        if extra > 0:
            seq.draft_pages += self.draft.pool.alloc(extra)

    def _release(self, seq: Sequence) -> None:
        super()._release(seq)
        if self.policy is not None:
            self.policy.forget(seq.seq_id)
        pages, seq.draft_pages = seq.draft_pages, []
        if pages:
            self.draft.pool.free(pages)

    # ---- compute -----------------------------------------------------------------------------
    def _prefill_logits(self, seqs: list[Sequence]) -> torch.Tensor:
        logits = super()._prefill_logits(seqs)
        inputs = [SeqInput(s.prompt_ids, 0, s.draft_pages) for s in seqs]
        self.draft.runner.forward(self.draft.pool, inputs, last_only=True)
        for seq in seqs:
            seq.draft_len = len(seq.prompt_ids)
        return logits

    def _propose_one(self, seq: Sequence, logits: torch.Tensor, q: list) -> int:
        if seq.params.greedy:
            return int(argmax_rows(logits[None])[0])
        dist = probs(logits[None], seq.params)[0]  # [V]
        q.append(dist)
        return _draw(dist, seq.generator)

    def _propose(self, seqs: list[Sequence], ks: list[int]) -> tuple[list, list]:
        """Draft ks[i] tokens for seqs[i]: (draft tokens, draft distributions) per sequence."""
        drafts: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        chain = DraftChain(ks, self.draft.min_confidence, self.draft.max_drafts)
        active = [i for i, k in enumerate(ks) if k > 0]
        inputs = []
        for i in active:  # first forward: every token without draft KV, up to the last one
            s = seqs[i]
            tokens = (s.prompt_ids + s.output_ids)[s.draft_len :]
            inputs.append(SeqInput(tokens, s.draft_len, s.draft_pages))
            s.draft_len = s.num_tokens
        j = 0
        while active:
            logits = self.draft.runner.forward(self.draft.pool, inputs, last_only=True)
            rows = _penalised_rows(
                [seqs[i] for i in active], [lg[-1:] for lg in logits], [drafts[i] for i in active]
            )
            for i, row in zip(active, rows, strict=True):
                drafts[i].append(self._propose_one(seqs[i], row[-1], qs[i]))
                chain.drafted(i, seqs[i], row[-1], drafts[i], qs[i])
            j += 1
            active = [i for i in active if chain.wants(i, j)]
            inputs = []
            for i in active:
                s = seqs[i]
                inputs.append(SeqInput([drafts[i][-1]], s.draft_len, s.draft_pages))
                s.draft_len += 1
        return drafts, qs

    def _decode(self, decoding: list[Sequence], out: StepOutput) -> None:
        saved = [s.draft_len for s in decoding]  # a failed step leaves the draft KV as it was
        try:
            self._spec_step(decoding, out)
        except Exception:
            for s, n in zip(decoding, saved, strict=True):
                s.draft_len = n
            raise

    def _pending(self, seq: Sequence) -> int:
        """Tokens the draft must catch up before it drafts (<= 2 while it drafts every step)."""
        return seq.num_tokens - seq.draft_len

    def _plan(self, decoding: list[Sequence], k: int) -> list[int]:
        """Each sequence's k this step: clamped to its remaining tokens, 0 where the policy
        keeps it from drafting."""
        ks = [min(k, s.params.max_tokens - len(s.output_ids) - 1) for s in decoding]
        if self.policy is None or not k:
            return ks
        before = self.policy.stats.switched_off
        go = self.policy.plan([s.seq_id for s in decoding])
        self.stats.switched_off += self.policy.stats.switched_off - before
        self.stats.undrafted_steps += sum(not g and x > 0 for g, x in zip(go, ks, strict=True))
        return [x if g else 0 for g, x in zip(go, ks, strict=True)]

    def _spec_step(self, decoding: list[Sequence], out: StepOutput) -> None:
        d = self.draft
        k = 0 if d.max_batch and len(decoding) > d.max_batch else d.num_spec_tokens
        ks = self._plan(decoding, k)
        t0 = time.perf_counter()
        drafting = sum(x > 0 for x in ks)
        timed = all(self._pending(s) <= x + 1 for s, x in zip(decoding, ks, strict=True) if x)
        if not drafting and self.plain_when_undrafted:
            super()._decode(decoding, out)  # LLMEngine's: the target's own step
        else:
            self._verify_step(decoding, ks, out)
        if self.policy is not None and k:
            self.policy.step_time(len(decoding), drafting, time.perf_counter() - t0, timed)

    def _verify_step(self, decoding: list[Sequence], ks: list[int], out: StepOutput) -> None:
        drafts, qs = self._propose(decoding, ks)
        inputs = [
            self._seq_input(s, [s.output_ids[-1]] + d, s.num_tokens - 1)
            for s, d in zip(decoding, drafts, strict=True)
        ]
        logits = self._verify_logits(decoding, inputs, drafts)  # per seq [k_i + 1, V]
        penalised = _penalised_rows(decoding, logits, drafts)
        done: list[tuple[int, list[int], int]] = []  # (index in decoding, emitted, accepted)
        for i, (seq, lg, d, q) in enumerate(zip(decoding, penalised, drafts, qs, strict=True)):
            try:
                if seq.params.greedy:
                    tokens, m = accept_greedy(lg, d)
                else:
                    p = probs(lg, seq.params)
                    tokens, m = accept_sampled(p, torch.stack(q) if q else p[:0], d, seq.generator)
            except Exception as e:  # this sequence only
                self._fail_seq(seq, f"sampling failed: {type(e).__name__}: {e}", out)
                continue
            done.append((i, tokens, m))
        lps = _emitted_logprobs(decoding, logits, done)
        for (i, tokens, m), lp in zip(done, lps, strict=True):
            self._accept(decoding[i], tokens, m, len(drafts[i]), out, lp)

    def _verify_logits(
        self, seqs: list[Sequence], inputs: list[SeqInput], drafts: list[list[int]]
    ) -> list:
        """The target's logits of each verify input. An engine that verified other chains
        beside them may put the chain it keeps into ``drafts[i]`` (its logits then)."""
        return self.runner.forward(self.pool, inputs)

    def _accept(
        self,
        seq: Sequence,
        tokens: list[int],
        m: int,
        proposed: int,
        out: StepOutput,
        logprobs: list[TokenLogprob | None] | None = None,
    ) -> None:
        # draft KV is valid only where the fed tokens were accepted
        seq.draft_len = min(seq.draft_len, seq.num_tokens + m)
        if proposed:
            seq.num_proposed += proposed
            seq.num_accepted += m
            seq.num_verify_steps += 1
            self.stats.proposed += proposed
            self.stats.accepted += m
            self.stats.verify_steps += 1
            if self.policy is not None:
                self.policy.observe(seq.seq_id, proposed, m)
        for j, token in enumerate(tokens):
            self._emit(seq, token, out, logprobs[j] if logprobs else None)
            if seq.finished:
                break  # EOS / max_tokens inside the accepted run: drop the rest
