"""One prefill forward over a batch of rooms (the prefill stage's compute step, no Triton).

The compute thread takes registered rooms in registration order while their prompts fit
``max_prefill_tokens`` (:func:`take`) and runs them as ONE forward (:func:`compute`): after each
layer group, every live room of the batch gets its ``send_group`` with the batch's one completion
fence, so layer-grouped streaming keeps working for all of them. Then each room's first token is
sampled from its own last position (its own sampling parameters, generator and penalties) and
sent before the KV lands; the draft's prompt KV follows as the ``draft`` entry.

One room's failure (a send that raises, a room decode aborted between groups, a sampling error)
fails that room only: it leaves the batch, and the forward goes on for the others; the forward
stops early only when no room is left. Anything else that raises (the forward, sampling,
logprobs, the draft) fails every room still in the batch: :func:`compute` raises nothing, each
member carries its error, and the worker aborts each failed room (its pages freed, decode told at
once).

A prompt longer than the budget is computed alone, in chunks of ``max_prefill_tokens`` (chunked
prefill): each chunk reads the earlier chunks' KV from the pool through its pages, and the last
chunk's layer groups are what streams (then every page of the room holds the layer's final KV).

A hybrid model's layer group [a, b) streams each entry's layers in it: the attention layers'
pages (entry ``target``) and the recurrent layers' final states (entry ``target.state``, the
room's slot), behind the same fence; a state is final once its layer ran over the whole prompt,
so it goes with its group and never waits for the last one (:func:`entry_layers`).
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvtransfer import KVSender

from ...runtime.config import ModelConfig
from ...runtime.eagle import EagleHead
from ...runtime.kv_pool import KVPool
from ...runtime.paged import SeqInput
from ...runtime.prefix_cache import Lease
from ...runtime.runner import ModelRunner
from ...runtime.sampler import generator, sample, token_logprobs
from ...runtime.state_pool import slot_of
from ..draft import DRAFT, copy_prefix_kv
from ..policy import LayerGroupPolicy
from ..request import CACHED_KEY, FEATURE_KEY, StageRequest, logprob_extra

Groups = list[tuple[int, int]]


@dataclass(frozen=True)
class BatchContext:
    """What a forward uses of its prefill stage: built once by the worker, shared by every batch."""

    runner: ModelRunner
    pool: KVPool
    sender: KVSender
    policy: LayerGroupPolicy
    max_prefill_tokens: int  # a longer prompt is computed alone, in chunks of it
    # completion fence of the work queued so far on the compute stream (None on CPU); the
    # sender's transfer worker waits on it, never the compute thread
    record_fence: Callable[[], object]
    draft: ModelRunner | EagleHead | None = None  # None: speculative decoding off
    draft_pool: KVPool | None = None
    draft_is_prefix: bool = False  # a self-draft: its prompt KV is copied from the target's


class RoomGone(RuntimeError):
    """The room ended (aborted, timed out) while prefill computed it: stop computing it."""


@dataclass
class Member:
    """One room of a batch: its request, pages (every pool) and what happened to it."""

    req: StageRequest
    pages: dict[str, list[int]]
    timing: dict = field(default_factory=dict)
    lease: Lease | None = None  # its target pages in a cached pool (the cached prefix first)
    first_token: int | None = None
    extra: dict = field(default_factory=dict)  # Complete's extra (the first token's logprobs)
    error: Exception | None = None


def _head_prompt(ctx: BatchContext, live: list[Member], feats: dict) -> None:
    run = [m for m in live if len(m.req.prompt_ids) > 1]  # pairs (f_i, x_{i+1}), i < P - 1
    if run:
        seqs = [SeqInput(m.req.prompt_ids[1:], 0, m.pages[DRAFT]) for m in run]
        f = [feats[id(m)][:-1] for m in run]
        ctx.draft.forward_head(ctx.draft_pool, seqs, f, logits=False)
    for m in live:
        m.extra[FEATURE_KEY] = feats[id(m)][-1].float().tolist()


def take(ready: deque[int], tokens_of: Callable[[int], int | None], budget: int) -> list[int]:
    """Pop the rooms of the next batch from the front of ``ready``: in order, while their prompt
    tokens fit ``budget`` (the first one always goes, alone when it exceeds the budget: it is
    chunked). ``tokens_of(room)`` is None for a room that is no longer ready (dropped)."""
    out, total = [], 0
    while ready:
        n = tokens_of(ready[0])
        if n is None:
            ready.popleft()
            continue
        if out and total + n > budget:
            break
        out.append(ready.popleft())
        total += n
    return out


def gather(
    cond: threading.Condition,
    burst: Callable[[float], tuple[int, bool]],
    budget: int,
    window: float,
) -> None:
    """Holds ``cond``. A burst's rooms become ready one by one, as decode registers each: wait
    while the batch has room and more are on their way (``burst(now)`` -> ready tokens,
    arriving), at most ``window`` seconds. A lone request does not wait."""
    end = time.monotonic() + window
    while True:
        now = time.monotonic()
        ready, arriving = burst(now)
        if now >= end or ready >= budget or not arriving:
            return
        cond.wait(end - now)  # a registration notifies


def entry_layers(cfg: ModelConfig, a: int, b: int) -> dict[str, range]:
    """Each target entry's own layers among model layers [a, b) (an entry numbers only its
    layers: the KV pool's layer j is attention layer j); entries without one are left out."""
    out = {}
    kinds = (
        ("target", cfg.full_kv_layers),
        ("target.window", cfg.window_kv_layers),
        ("target.state", cfg.recurrent_layers),
    )
    for role, layers in kinds:
        lo, hi = bisect_left(layers, a), bisect_left(layers, b)
        if hi > lo:
            out[role] = range(lo, hi)
    return out


def chunks(n: int, budget: int) -> list[tuple[int, int]]:
    """[start, end) pieces of a prompt of ``n`` tokens, each at most ``budget`` long."""
    return [(a, min(a + budget, n)) for a in range(0, n, budget)]


def compute(ctx: BatchContext, members: list[Member], groups: Groups | None = None) -> None:
    """Run ``members`` (rooms already started on the sender) as one prefill and finish each:
    first token and Complete for those that got through, ``member.error`` for the others."""
    runner, sender, budget = ctx.runner, ctx.sender, ctx.max_prefill_tokens
    n_layers = runner.config.num_layers
    live = list(members)

    def drop(m: Member, e: Exception) -> None:
        if m.error is None:
            m.error = e
        if m in live:
            live.remove(m)

    def on_group(a: int, b: int) -> None:  # layers [a, b) are launched: fence, hand over
        fence = ctx.record_fence()
        parts = entry_layers(runner.config, a, b)
        for m in list(live):
            m.timing.setdefault("groups", []).append([a, b, time.time()])
            try:
                for role, layers in parts.items():
                    sender.send_group(m.req.room, role, layers, fence)
                if b < n_layers and not sender.is_live(m.req.room):
                    raise RoomGone("the room ended while prefill computed it")
            except Exception as e:  # this room only
                drop(m, e)
        if not live:
            raise RoomGone("every room of the batch ended while prefill computed it")

    seqs = [_suffix(m) for m in members]
    head = isinstance(ctx.draft, EagleHead)  # it reads the target's features
    try:
        early: list = []
        if len(members) == 1 and len(seqs[0].token_ids) > budget:  # chunked prefill
            last, early = _earlier_chunks(ctx, members[0], budget, head)
            seqs = [last]
        total = sum(len(s.token_ids) for s in seqs)
        groups = groups or ctx.policy.groups(total, n_layers)
        out = runner.prefill_batch(ctx.pool, seqs, groups, on_group, features=head)
        for m in live:  # the prompt's KV is final: its blocks may serve later prompts
            if m.lease is not None:
                m.lease.commit(m.req.prompt_ids, len(m.req.prompt_ids))
        logits, feats = out if head else (out, None)  # [B, vocab]; per room [P, hidden]
        if early:
            feats = [torch.cat([*early, *feats])]
        _first_tokens(ctx, members, live, logits, drop)
        for m in live:  # usage reports the prompt tokens no one computed
            m.extra[CACHED_KEY] = _suffix(m).start_pos
        _draft(ctx, live, drop, dict(zip(map(id, members), feats or [], strict=False)))
    except Exception as e:  # the forward, sampling or logprobs failed, or no room is left:
        for m in list(live):  # every room still live fails (the worker aborts each)
            drop(m, e)


def _suffix(m: Member) -> SeqInput:
    """What a forward computes of ``m``'s prompt: the tokens after its cached prefix."""
    cached = m.lease.num_cached_tokens if m.lease is not None else 0
    ids = m.req.prompt_ids
    window = m.pages.get("target.window")  # a page per prompt block: prefill writes them all
    return SeqInput(ids[cached:], cached, m.pages["target"], slot_of(m.pages), window)


def _earlier_chunks(ctx: BatchContext, m: Member, budget: int, features: bool):
    """Prefill every chunk of ``m``'s prompt (after its cached prefix) but the last (no
    streaming: later chunks rewrite nothing, but a layer's KV is complete only after the last
    chunk). -> (the last chunk's input, the earlier chunks' features when asked for)."""
    ids, pages, slot = m.req.prompt_ids, m.pages["target"], slot_of(m.pages)
    start, window = _suffix(m).start_pos, m.pages.get("target.window")
    *first, (a, b) = [(start + c0, start + c1) for c0, c1 in chunks(len(ids) - start, budget)]
    feats = []
    for c0, c1 in first:  # a recurrent state carries from chunk to chunk in the room's slot
        chunk = [SeqInput(ids[c0:c1], c0, pages, slot, window)]
        out = ctx.runner.prefill_batch(ctx.pool, chunk, features=features)
        feats += out[1] if features else []
        if not ctx.sender.is_live(m.req.room):
            raise RoomGone("the room ended while prefill computed it")
    return SeqInput(ids[a:b], a, pages, slot, window), feats


def _first_tokens(ctx: BatchContext, members, live, logits, drop) -> None:
    rows = [i for i, m in enumerate(members) if m in live]
    batch = [members[i] for i in rows]
    sps = [m.req.sampling for m in batch]
    gens = [generator(sp, ctx.runner.device) for sp in sps]
    errors: dict[int, str] = {}
    hist = [(m.req.prompt_ids, []) for m in batch]
    firsts = sample(logits[rows], sps, gens, errors=errors, histories=hist)
    lps = token_logprobs(logits[rows], firsts, sps)
    for j, m in enumerate(batch):
        if j in errors:
            drop(m, RuntimeError(f"sampling failed: {errors[j]}"))
            continue
        m.first_token, m.extra = firsts[j], logprob_extra(lps[j])
        m.timing["computed"] = time.time()
        try:
            ctx.sender.first_token(m.req.room, m.first_token)  # before the KV lands
        except Exception as e:
            drop(m, e)


def _draft(ctx: BatchContext, live: list[Member], drop, feats: dict) -> None:
    """The draft's prompt KV of every room still live (entry ``draft``), then Complete; an
    EAGLE head's: its pairs of the prompt's features ``feats`` (id(member) -> [P, hidden])
    and tokens, and Complete carries the last prompt position's feature."""
    if ctx.draft is not None and live:
        try:
            if feats:
                _head_prompt(ctx, live, feats)
            elif ctx.draft_is_prefix:
                for m in live:
                    target, draft = m.pages["target"], m.pages[DRAFT]
                    copy_prefix_kv(ctx.pool, target, ctx.draft_pool, draft)
            else:
                seqs = [SeqInput(m.req.prompt_ids, 0, m.pages[DRAFT]) for m in live]
                ctx.draft.prefill_batch(ctx.draft_pool, seqs)
        except Exception as e:
            for m in list(live):
                drop(m, e)
        fence = ctx.record_fence()
        for m in list(live):
            try:
                layers = range(ctx.draft.config.num_layers)
                ctx.sender.send_group(m.req.room, DRAFT, layers, fence)
                m.timing["draft_computed"] = time.time()
            except Exception as e:
                drop(m, e)
    for m in list(live):
        try:
            ctx.sender.finish(m.req.room, m.first_token, m.extra)
        except Exception as e:
            drop(m, e)
