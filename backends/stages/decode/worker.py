"""Decode stage core (no Triton): receive prompt KV from prefill, continuous-batching decode.

One :class:`DecodeWorker` per decode instance owns the model runner, its KV pool, a
:class:`~kvtransfer.KVReceiver` and an :class:`~backends.runtime.engine.LLMEngine` driven by ONE
background thread. With ``spec_enabled`` it also owns the draft (a model or an EAGLE head) and its
pool, registers pages of both (entries ``target`` and ``draft``) and runs a speculative engine
(``spec_engine``) from the transferred draft KV (a head: and the last prompt feature).

Per request (:meth:`DecodeWorker.submit`, any thread):

1. wait (FIFO, at most ``max_queue`` requests and ``queue_timeout_s``: backpressure, past the
   bound ``overloaded, retry later``) for pages for ``prompt + max_tokens - 1`` tokens in each
   pool, then register the prompt's pages with the request's prefill (which computes the room
   only now: it never computes for pages decode does not hold);
2. when the room reaches Success, hand the pages and the first token to the engine
   (``add_prefilled``, which owns the pages from then on);
3. each engine step emits the new tokens through the request's ``emit`` callback; while a
   request has nothing to send it gets a heartbeat event every ``HEARTBEAT_S`` so the serving
   layer can notice a client cancel in every phase (:mod:`.events`).

A failed transfer, a client cancel (``is_cancelled`` or :meth:`DecodeWorker.cancel`,
:mod:`.control`) or an engine error ends the request with one final event at once; its pages are
freed exactly once: by this worker before step 2 (after the room's quarantine when prefill may
still write into them, see kvtransfer/receiver/), by the engine after it. A room that failed
before its KV completed may be re-dispatched to another prefill server instead (:mod:`.failover`).

Local prefill (conditional disaggregation): a request the router marked ``LOCAL`` (short prompt,
or every prefill server busy) goes straight into this worker's engine, which prefills it in its
own pool: no pages registered, no KV transfer (:meth:`DecodeWorker._take_local`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from kvtransfer import KVReceiver, RoomStatus

from ...runtime.detok import TextState
from ...runtime.engine import LLMEngine, StepOutput
from ...runtime.runner import ModelRunner
from ...runtime.sampling_params import check_context
from ...runtime.spec import DraftSpec
from ...runtime.spec_eagle import spec_engine
from ...runtime.state_pool import pool_entries, slot_of
from ...runtime.tokenizer import Tokenizer, has_tokenizer
from .. import errors
from ..cancel import CancelListener
from ..draft import (
    DRAFT,
    draft_policy,
    explain_failure,
    load_stage_draft,
    make_draft_pool,
    spec_stats,
)
from ..fingerprint import deployment_identity
from ..latency import Observations
from ..params import StageParams
from ..prefix import cache_stats, stage_cache
from ..request import CACHED_KEY, StageRequest, draft_feature, first_logprob
from ..router import LOCAL, PrefillRouter
from ..shutdown import stopped
from ..tp import close_ranks, load_stage_model, make_stage_pool, rank_agents
from ..trace import TraceWriter
from .control import RequestControl
from .events import Responder, streams_early
from .failover import Failover
from .state import ActiveRequest, DecodeEvent, Emit, Phase, Requests

log = logging.getLogger(__name__)

__all__ = ["DecodeEvent", "DecodeWorker"]

# at close, how long the step in progress may finish: a decode step takes milliseconds (one
# that prefills a prompt here: seconds), and the final errors must go out well within a stopping
# server's 30 s (serve.sh --stop-timeout); a thread still in its step after this is stuck
JOIN_S = 10.0

COUNTERS = (
    "requests",
    "failed",
    "cancelled",
    "overloaded",
    "steps",
    "max_batch",
    "last_batch",
    "tokens",
    "loop_errors",
    "local_prefills",
)


class DecodeWorker:
    """Owns the model, its pools, the receiver, the engine, the table of held requests and the
    loop thread; its request control (:class:`~.control.RequestControl`), events
    (:class:`~.events.Responder`) and failover (:class:`~.failover.Failover`) are objects it
    builds and hands what they use."""

    def __init__(self, params: StageParams, runner: ModelRunner | None = None, name="decode"):
        self.params = params
        self.runner = runner or load_stage_model(params)
        # text is detokenized here, where stop strings end a sequence (None: a checkpoint
        # without a tokenizer, as in some tests: no text, no stop strings)
        self.tok = Tokenizer(params.model_path) if has_tokenizer(params.model_path) else None
        self.eos_ids = self.runner.config.eos_token_ids
        self.pool = make_stage_pool(self.runner, params, name)
        self.draft = load_stage_draft(params, self.runner)  # None: speculative decoding off
        self.pools = pool_entries(self.pool)  # target KV (+ a hybrid's state slots)
        self.cache, self.kv_events = stage_cache(params, self.runner, self.pool, name)
        size = (params.max_batch, params.max_context)
        opts = dict(tokenizer=self.tok, prefix_cache=self.cache)
        if self.draft is None:
            self.engine = LLMEngine(self.runner, self.pool, *size, **opts)
        else:
            dpool = self.pools[DRAFT] = make_draft_pool(params, self.draft)
            spec = DraftSpec(self.draft, dpool, params.spec_tokens, params.spec_max_batch,
                             draft_policy(params), params.spec_min_confidence,
                             params.spec_branches, params.spec_max_drafts)  # fmt: skip
            self.engine = spec_engine(self.runner, self.pool, spec, *size, **opts)
        cfg = params.transfer_config(identity=deployment_identity(params))
        runners = {"target": self.runner, DRAFT: self.draft}
        self.agents = rank_agents(cfg, cfg.staging_recv_slots, runners, self.pools)
        self.receiver = KVReceiver(
            cfg,
            {role: p.layout for role, p in self.pools.items()},
            {role: p.tensor for role, p in self.pools.items()},  # staged transfers
            self.agents,  # tensor parallel: ranks 1..N-1 receive their own shards
        )
        self.name = name
        self.trace = TraceWriter(params.trace_dir, name)
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.counters.update(ttft_sum=0.0, ttft_count=0, itl_sum=0.0, itl_count=0)
        self.latency = Observations()  # histograms (backends/stages/latency.py)
        self.receiver.transfer_stats.observer = self.latency.room_done
        self.requests = Requests()  # every request held, by phase; the loop waits on its cond
        self.out = Responder(
            name, self.tok, self.counters, self.latency, self.trace, self._client_gone
        )
        self.control = RequestControl(
            self.requests,
            self.out,
            self.receiver,
            self.engine,
            self.counters,
            params.queue_timeout_s,
            name,
        )
        # clients cancel through this channel too (see backends/stages/cancel.py)
        self.cancel_listener = CancelListener(
            cfg.host, self.cancel, cfg.shared_secret, cfg.max_message_age_s
        )
        self.cancel_addr = self.cancel_listener.addr
        # hand-offs to the loop thread (under requests.cond)
        self._ready: deque[tuple[int, RoomStatus]] = deque()  # rooms released (control thread)
        self._failed: deque[tuple[int, str]] = deque()  # rooms failed (control thread)
        self._firsts: deque[tuple[int, int]] = deque()  # prefill's first tokens (control thread)
        self._rerouted: deque[tuple[ActiveRequest, str | None]] = deque()  # failover's results
        self._local: deque[ActiveRequest] = deque()  # to prefill in this engine
        self._stop = False
        self.failover = Failover(
            self._failover_router(params),
            params.failover_attempts,
            self._on_rerouted,
            lambda: self._stop,
            name,
        )
        self._thread = threading.Thread(target=self._loop, name=f"{name}-loop", daemon=True)
        self._thread.start()

    def _failover_router(self, params: StageParams) -> PrefillRouter | None:
        """A decode server's router, to re-dispatch a failed room (None: no prefill_servers)."""
        if not params.prefill_servers:
            return None
        return PrefillRouter(
            params.servers(),
            params.route_timeout_s,
            params.probe_interval_s,
            name=f"{self.name}-failover",
            fingerprint=self.receiver.fingerprint,
            page_size=params.page_size,
            route_policy=params.route_policy,
        )

    # ---- public API (any thread) -------------------------------------------------------------
    def validate(self, req: StageRequest) -> None:
        n, m = len(req.prompt_ids), req.sampling.max_tokens
        if n == 0:
            raise errors.InvalidRequest("prompt is empty: at least one token is required")
        try:
            check_context(n, m, self.params.max_context)
        except ValueError as e:
            code = errors.CONTEXT_LENGTH_EXCEEDED
            raise errors.InvalidRequest(str(e), "max_tokens", code) from None
        for role, pool in self.pools.items():
            need = pool.pages_needed(n + m - 1)
            if need > pool.num_pages:
                what = "" if role == "target" else f"{role} "
                raise errors.InvalidRequest(
                    f"request needs {need} {what}KV pages, the decode {what}pool has only"
                    f" {pool.num_pages}: it can never run here"
                )
        if not req.bootstrap_addr:
            raise ValueError("no prefill bootstrap address")
        if req.sampling.stop and self.tok is None:
            raise errors.InvalidRequest(
                "stop strings need a tokenizer: this model directory has none", "stop"
            )

    def submit(self, req: StageRequest, emit: Emit, is_cancelled: Callable[[], bool] | None = None):
        """Queue a request; raises ValueError (invalid: nothing queued) or errors.Overloaded.
        A room id already in use is refused without touching the request that owns it."""
        r = ActiveRequest(req, emit, is_cancelled)
        if self.tok is not None:
            r.text = TextState(self.tok, req.sampling.stop)
        held = self.requests
        with held.cond:
            if held.holds(req.room):
                raise ValueError(f"room {req.room} is already in use")
        try:
            self.validate(req)
            with held.cond:
                if self._stop:
                    raise errors.Overloaded(f"{self.name} is shutting down")
                if len(held.waiting) >= self.params.max_queue:
                    self.counters["overloaded"] += 1
                    raise errors.Overloaded(f"{len(held.waiting)} requests wait for KV pages")
                self.counters["requests"] += 1
                r.t["submitted"], r.queued_at = time.time(), time.monotonic()
                r.last_event = r.queued_at
                held.waiting.append(r)
        except (ValueError, errors.Overloaded) as e:
            self.control.refuse(req, str(e))
            raise
        self._register_waiting()
        with held.cond:
            held.cond.notify_all()

    def cancel(self, room: int) -> None:
        """Stop a request (any thread): it ends with a final event, its pages are freed."""
        self.control.cancel(room)

    @property
    def pages_in_use(self) -> int:
        """Pages allocated in the target pool plus the draft pool (when there is one)."""
        return sum(p.pages_in_use for p in self.pools.values())

    def stats(self) -> dict:
        snap = self.receiver.stats()
        transfer_errors = snap.get("loop_errors", 0)
        held = self.requests
        with held.cond:
            snap.update(self.counters)
            snap.update(self.failover.counters)
            snap["waiting"] = len(held.waiting) + len(held.transfers) + len(self.engine.waiting)
            snap["running"] = len(self.engine.running)
            quarantined = [r for r in held.transfers.values() if r.phase == Phase.DONE]
            snap["quarantined_pages"] = sum(len(p) for r in quarantined for p in r.pages.values())
        snap["loop_errors"] += transfer_errors
        lis = self.cancel_listener  # its drops count with the control plane's
        cancel_drops = {f"cancel_{k}": n for k, n in dict(lis.dropped_by_kind).items()}
        snap["dropped_frames"].update(cancel_drops)
        snap["dropped_total"] += sum(cancel_drops.values())
        snap["pages_in_use"] = self.pages_in_use
        snap["num_pages"] = sum(p.num_pages for p in self.pools.values())
        if self.draft is not None:
            snap.update(spec_stats(self.engine))
        snap.update(cache_stats(self.cache))
        return snap

    def idle(self) -> bool:
        """No request held in any phase."""
        return not self.requests.all()

    def close(self, join_s: float = JOIN_S) -> None:
        """Stop the loop thread (the step it runs may finish, for at most ``join_s`` seconds);
        then every request not yet finished gets a final error (a room still transferring is
        aborted: prefill is told to stop writing, best effort) and the threads stop. A loop
        thread still in its step after ``join_s`` (a hung kernel or rank) still uses the
        receiver and the ranks: they stay open (an error is logged) and go with the process."""
        with self.requests.cond:
            self._stop = True
            self.requests.cond.notify_all()
        stuck = not stopped(self._thread, join_s, self.name, "the KV receiver and the ranks")
        for r in self.requests.all():
            if r.phase == Phase.TRANSFER:
                self.receiver.abort(r.req.room, "decode instance shutting down")
            if r.phase != Phase.DONE:
                self.out.finish(r, error="decode instance shutting down", kind=errors.OVERLOADED)
        self.failover.close()
        self.cancel_listener.close()
        if self.kv_events is not None:
            self.kv_events.close()
        if not stuck:
            self.receiver.close()
            close_ranks([self.runner, self.draft], self.agents)

    # ---- hand-offs to the loop thread --------------------------------------------------------
    def _post(self, inbox: deque, item) -> None:
        with self.requests.cond:
            inbox.append(item)
            self.requests.cond.notify_all()

    def _on_release(self, room: int, status: RoomStatus) -> None:  # control thread
        self._post(self._ready, (room, status))

    def _on_fail(self, room: int, reason: str) -> None:  # control thread
        self._post(self._failed, (room, reason))

    def _on_first(self, room: int, token: int) -> None:  # control thread
        self._post(self._firsts, (room, token))

    def _on_rerouted(self, nxt: ActiveRequest, err: str | None) -> None:  # failover's threads
        self._post(self._rerouted, (nxt, err))

    def _client_gone(self, r: ActiveRequest) -> None:  # its emit raised: stop generating
        self.control.cancel_one(r)

    # ---- registration ------------------------------------------------------------------------
    def _register_waiting(self) -> None:
        """Give pages to waiting requests in FIFO order and register them with prefill."""
        held = self.requests
        while True:
            with held.cond:
                if not held.waiting:
                    return
                r = held.waiting[0]
                if r.req.bootstrap_addr == LOCAL:  # prefilled here by the engine: no pages yet
                    self._local.append(held.waiting.popleft())
                    held.cond.notify_all()
                    continue
                need = self._need(r)
                if not self._fits(r.req.prompt_ids, need):
                    return
                held.waiting.popleft()
                r.pages, r.lease = self._alloc(r.req.prompt_ids, need)
                r.phase = Phase.TRANSFER
                held.transfers[r.req.room] = r
            self._register(r)

    def _need(self, r: ActiveRequest) -> dict[str, int]:
        """Pages of every entry a prefilled request holds from admission to its end: for
        prompt + max_tokens (a sliding-window entry: what its window reaches at once)."""
        prompt, new = len(r.req.prompt_ids), r.req.sampling.max_tokens
        need = {role: p.pages_needed(prompt + new - 1) for role, p in self.pools.items()}
        plan = self.engine.window_plan(prompt, new)
        if plan is not None:
            need[self.pool.window.layout.role] = plan.reserve
        return need

    def _fits(self, prompt: list[int], need: dict[str, int]) -> bool:
        """Every entry has the pages ``need`` asks for (the target's cached prefix counted as
        held: only the rest is allocated)."""
        for role, pool in self.pools.items():
            if role == "target" and self.cache is not None:
                if not self.cache.fits(prompt, need[role], len(prompt)):
                    return False
            elif need[role] > pool.num_free:
                return False
        return True

    def _alloc(self, prompt: list[int], need: dict[str, int]):
        """(pages of every entry, the target's lease in a cached pool: the prompt's cached blocks
        first, which prefill then sends none of). Call after :meth:`_fits`."""
        pages: dict[str, list[int]] = {}
        lease = None
        for role, pool in self.pools.items():
            if role == "target" and self.cache is not None:  # a whole-prompt hit is allowed:
                lease = self.cache.acquire(prompt, need[role], len(prompt))  # prefill samples
                pages[role] = lease.pages
            else:
                pages[role] = pool.alloc(need[role])
        return pages, lease

    def _register(self, r: ActiveRequest) -> None:
        prompt = len(r.req.prompt_ids)
        first = {"target": r.lease.num_cached_pages} if r.lease is not None else {}
        dst = {
            role: r.pages[role][first.get(role, 0) : self.pools[role].pages_needed(prompt)]
            for role in r.pages
        }
        window = self.pool.window
        if window is not None:  # only the blocks the prompt's last window reaches move
            role = window.layout.role
            first[role], count = window.layout.pages_for(prompt)
            dst[role] = r.pages[role][:count]
        callbacks = (self._on_release, self._on_fail, self._on_first)
        try:
            self.receiver.register(
                r.req.room, [r.req.bootstrap_addr], dst, prompt, *callbacks, first=first
            )
            r.t["registered"] = time.time()
        except Exception as e:  # bad address, room id in use...: this request only
            with self.requests.cond:
                self.requests.transfers.pop(r.req.room, None)
            self._free(r)
            self.out.finish(r, error=f"registering KV pages with prefill failed: {e}")

    # ---- loop thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop:
            with self.requests.cond:
                busy = self._ready or self._failed or self.control.pending or self._rerouted
                busy = busy or self._local or self._firsts
                if not (busy or self.engine.has_unfinished()):
                    self.requests.cond.wait(0.05)
            try:
                self.control.poll()
                self._take_first()
                self._take_failed()
                self._take_rerouted()
                self._take_local()
                self._take_ready()
                self._register_waiting()
                self.control.expire_waiting()
                if self.engine.has_unfinished():
                    self._step()
                self.out.heartbeats(self.requests.all())
            except Exception:  # the loop never dies: count, log, go on
                self.counters["loop_errors"] += 1
                log.exception("%s: decode loop iteration failed", self.name)
                time.sleep(0.01)

    def _next_of_room(self, inbox: deque, pop: bool = False):
        """The oldest (room, value) of ``inbox`` and the request transferring into that room
        (None if none; taken out of the transfers with ``pop``), or None when ``inbox`` is
        empty."""
        with self.requests.cond:
            if not inbox:
                return None
            room, value = inbox.popleft()
            transfers = self.requests.transfers
            return room, value, transfers.pop(room, None) if pop else transfers.get(room)

    def _take_first(self) -> None:
        """Prefill's first token, before the room's KV landed: a streaming request gets it at
        once (non-streaming requests are unchanged; the engine reports it again later)."""
        while (got := self._next_of_room(self._firsts)) is not None:
            _room, token, r = got
            if r is None or r.phase != Phase.TRANSFER or r.out_ids:
                continue
            if not streams_early(r, token, self.eos_ids):
                continue
            now = time.time()
            r.early_first, r.out_ids = token, [token]
            r.t["first_token"] = r.t["first_token_streamed"] = r.t["last_token"] = now
            self.counters["tokens"] += 1
            self.counters["ttft_sum"] += now - r.t["submitted"]
            self.counters["ttft_count"] += 1
            self.out.send(r, self.out.event(r, [token], []))

    def _take_failed(self) -> None:
        """Rooms that failed: the request ends now, or is re-dispatched under a fresh room; its
        pages wait for the room's release."""
        while (got := self._next_of_room(self._failed)) is not None:
            _room, reason, r = got
            if r is not None and r.phase == Phase.TRANSFER and not self.failover.retry(r, reason):
                after = " after the first token was streamed" if r.early_first is not None else ""
                self.out.finish(r, error=f"KV transfer failed{after}: {explain_failure(reason)}")

    def _take_rerouted(self) -> None:
        """Re-dispatched requests: first in line for new pages (they waited already), or ended
        with the error when no prefill server took them."""
        while True:
            with self.requests.cond:
                if not self._rerouted:
                    return
                nxt, err = self._rerouted.popleft()
                if err is None and not nxt.cancel_requested():
                    nxt.queued_at = time.monotonic()
                    self.requests.waiting.appendleft(nxt)
                    continue
            if err is None:  # cancelled meanwhile: nothing registered yet
                nxt.cancelled = True
                self.control.refuse(nxt.req, "client cancelled")
            self.out.finish(nxt, error=err)

    def _take_local(self) -> None:
        """Requests the router left to this server: the engine prefills them in its own pool."""
        while True:
            with self.requests.cond:
                if not self._local:
                    return
                r = self._local.popleft()
            try:
                seq = self.engine.add_request(r.seq_id, r.req.prompt_ids, r.req.sampling)
                r.text = seq.text  # the engine's detokenizer (a fresh one: nothing streamed yet)
            except Exception as e:  # this request only
                self.out.finish(r, error=f"decode could not take the request: {e}")
                continue
            r.t["local_prefill"] = time.time()
            self.counters["local_prefills"] += 1
            r.phase = Phase.RUNNING
            self.requests.running[r.seq_id] = r

    def _take_ready(self) -> None:
        while (got := self._next_of_room(self._ready, pop=True)) is not None:
            room, status, r = got
            if r is None:
                continue
            r.t["transfer_done"] = time.time()
            if r.phase == Phase.DONE or status != RoomStatus.Success:  # failed / cancelled
                self._free(r)
                why = explain_failure(self.receiver.failure_reason(room) or status.name)
                self.out.finish(r, error=f"KV transfer failed: {why}")  # no-op when done
                continue
            try:
                first, extra = self.receiver.result(room)
                self.receiver.forget(room)
                self._add_prefilled(r, first, extra)
            except Exception as e:
                self._free(r)
                self.out.finish(r, error=f"decode could not take the prefilled request: {e}")
                continue
            r.phase = Phase.RUNNING
            self.requests.running[r.seq_id] = r

    def _add_prefilled(self, r: ActiveRequest, first: int, extra: dict) -> None:
        """Hand the request to the engine, which owns (and frees) its pages from then on."""
        lp, feature = first_logprob(extra, first, r.req.sampling), draft_feature(extra)
        r.cached_tokens = int(extra.get(CACHED_KEY, 0))
        self.engine.add_prefilled(
            r.seq_id,
            r.req.prompt_ids,
            r.pages["target"],
            first,
            r.req.sampling,
            draft_pages=r.pages.get(DRAFT),
            first_logprob=lp,
            text=r.text,
            draft_feature=feature,
            slot=slot_of(r.pages),
            lease=r.lease,
            window_pages=r.pages.get("target.window"),
        )
        r.pages, r.lease = {}, None

    def _free(self, r: ActiveRequest) -> None:
        pages, r.pages = r.pages, {}
        lease, r.lease = r.lease, None
        for role, ids in pages.items():
            if role == "target" and lease is not None:
                lease.release()
            else:
                self.pools[role].free(ids)

    def _step(self) -> None:
        batch = len(self.engine.running)
        start, cpu = time.time(), time.thread_time()
        out = self.engine.step()
        cpu, now = time.thread_time() - cpu, time.time()
        c = self.counters
        c["steps"] += 1
        c["last_batch"] = batch
        c["max_batch"] = max(c["max_batch"], batch)
        self._deliver(out, now)
        if self.trace.enabled:  # wall - cpu: the thread waited for a core (bench/trace_split.py)
            step = {"stage": "decode-step", "start": start, "end": now, "cpu": cpu, "batch": batch}
            self.trace.write({**step, "sent": time.time()})

    def _deliver(self, out: StepOutput, now: float) -> None:
        """Emit each sequence's new tokens of one step; finish the sequences that ended."""
        c = self.counters
        reasons = {s.seq_id: s.finish_reason for s in out.finished}
        for seq_id in set(out.new_tokens) | set(reasons):
            r = self.requests.running.get(seq_id)
            if r is None or r.phase == Phase.DONE:  # close() ended it while this step ran
                continue
            if seq_id in out.errors:  # this sequence failed; the others go on
                del self.requests.running[seq_id]
                self.out.finish(r, error=f"decode failed for this request: {out.errors[seq_id]}")
                continue
            tokens = out.new_tokens.get(seq_id, [])
            logprobs = out.logprobs.get(seq_id, [])
            if r.early_first is not None and tokens:  # streamed already, before the KV landed
                tokens, logprobs, r.early_first = tokens[1:], logprobs[1:], None
                if not tokens and seq_id not in reasons:
                    continue
            c["tokens"] += len(tokens)
            if "first_token" not in r.t:
                r.t["first_token"] = now
                if "local_prefill" in r.t:  # its cached prefix was leased when the prompt ran
                    r.cached_tokens = _cached_tokens(self.engine, out, seq_id)
                c["ttft_sum"] += now - r.t["submitted"]
                c["ttft_count"] += 1
            else:
                c["itl_sum"] += now - r.t["last_token"]
                c["itl_count"] += 1
                self.latency.observe("itl", now - r.t["last_token"])
            r.t["last_token"] = now
            final = seq_id in reasons
            if r.req.stream and tokens and not final:
                self.out.send(r, self.out.event(r, tokens, logprobs))
            r.out_ids += tokens
            r.out_logprobs += logprobs
            if final:
                del self.requests.running[seq_id]
                self.out.finish(r, reason=reasons[seq_id], tokens=tokens, logprobs=logprobs)


def _cached_tokens(engine, out: StepOutput, seq_id: str) -> int:
    """Prompt tokens of a locally prefilled sequence that its engine served from the prefix cache
    (known once the engine scheduled the prompt; a sequence that ended in this step left it)."""
    seq = engine.seqs.get(seq_id) or next((s for s in out.finished if s.seq_id == seq_id), None)
    return seq.num_cached_tokens if seq is not None else 0
