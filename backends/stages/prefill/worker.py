"""Prefill stage core (no Triton): run prompts layer group by layer group, stream KV to decode.

One :class:`PrefillWorker` per prefill instance owns the model runner, its KV pool, a
:class:`~kvtransfer.KVSender` (bootstrap endpoint ``bootstrap_addr``), the layer-group policy,
and ONE compute thread. :meth:`PrefillWorker.submit` queues a request; the compute thread takes
it only once decode has registered its destination pages (decode holds its pages: natural
backpressure, a request is never failed for waiting on decode), in registration order, batched
with the other registered rooms up to ``prefill_batch_tokens`` (:mod:`.batch`). Then, per
room: allocate pages, ``start_room``; for the batch: run the prompts group by group calling
``send_group`` for every room after each (with the group's completion fence), sample each first
token, ``finish``. The sender's release callback frees the pages once the room ended and no write
reads them any more.

Bounds: at most ``max_queue`` requests wait (more get :class:`~.errors.Overloaded` at once);
a request decode never registers leaves after ``queue_timeout_s``; a room decode aborted is
dropped before compute, or stops between layer groups. ``on_done(result)`` runs exactly once
per submitted request.

With ``spec_enabled`` (:mod:`..draft`) the worker also holds the draft model and a draft KV pool:
after the target's groups it runs the draft over the prompt (a self-draft's KV is copied from
the target's first layers instead) and sends those pages as the room's ``draft`` entry.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtransfer import KVSender, RoomStatus

from ...runtime.device import record_fence
from ...runtime.kv_pool import KVPool
from ...runtime.prefix_cache import Lease
from ...runtime.runner import ModelRunner
from ...runtime.state_pool import pool_entries
from ..draft import DRAFT, load_stage_draft, make_draft_pool, shares_target_layers
from ..errors import InvalidRequest, Overloaded
from ..fingerprint import deployment_identity
from ..latency import Observations
from ..params import StageParams
from ..prefix import cache_stats, stage_cache
from ..request import StageRequest
from ..shutdown import stopped
from ..tp import close_ranks, load_stage_model, make_stage_pool, rank_agents
from ..trace import TraceWriter
from .batch import BatchContext, Groups, Member, RoomGone, compute, gather, take

log = logging.getLogger(__name__)
DRAIN_S = 30.0  # at close, how long KV already computed may keep moving to its decode
# at close, how long the batch in progress may finish its forward: a batch of
# prefill_batch_tokens (512 by default) takes well under a second on a GPU and a few seconds on
# a CPU, and the aborts must go out well within a stopping server's 30 s (serve.sh
# --stop-timeout); a thread still in its forward after this is stuck (a hung kernel or rank)
JOIN_S = 10.0


@dataclass
class PrefillResult:
    room: int
    first_token: int | None = None
    error: str | None = None
    timing: dict = field(default_factory=dict)


class JobState(enum.IntEnum):
    WAITING = 0  # queued; decode has not registered its pages yet
    READY = 1  # registered: waiting for the compute thread (FIFO)
    COMPUTING = 2
    DONE = 3  # on_done ran


@dataclass
class _Job:
    req: StageRequest
    on_done: Callable[[PrefillResult], None] | None
    state: JobState = JobState.WAITING
    queued_at: float = field(default_factory=time.monotonic)


class PrefillWorker:
    def __init__(
        self,
        params: StageParams,
        runner: ModelRunner | None = None,
        instance_index: int = 0,
        name: str = "prefill",
    ):
        self.params = params
        self.runner = runner or load_stage_model(params)
        self.pool: KVPool = make_stage_pool(self.runner, params, name)
        self.draft = load_stage_draft(params, self.runner)  # None: speculative decoding off
        self.draft_pool = make_draft_pool(params, self.draft) if self.draft else None
        self.cache, self.kv_events = stage_cache(params, self.runner, self.pool, name)
        self._batch_tokens = min(params.prefill_batch_tokens, params.max_prefill_tokens)
        self._gather_s = params.prefill_gather_ms / 1e3  # see _burst
        cfg = params.transfer_config(instance_index, deployment_identity(params))
        runners = {"target": self.runner, DRAFT: self.draft}
        self.agents = rank_agents(cfg, cfg.staging_slots, runners, dict(self._pools()))
        self.sender = KVSender(
            cfg,
            {role: pool.layout for role, pool in self._pools()},
            {role: pool.tensor for role, pool in self._pools()},  # staged transfers
            self.agents,  # tensor parallel: ranks 1..N-1 send their own shards
        )
        self.bootstrap_addr = self.sender.bootstrap_addr
        self.latency = Observations()  # histograms (backends/stages/latency.py)
        self.sender.transfer_stats.observer = self.latency.room_done
        self.name = f"{name}{instance_index}"
        self.trace = TraceWriter(params.trace_dir, self.name)
        device = self.runner.device
        self.batch = BatchContext(
            runner=self.runner,
            pool=self.pool,
            sender=self.sender,
            policy=params.policy(),
            max_prefill_tokens=params.max_prefill_tokens,
            record_fence=lambda: record_fence(device),
            draft=self.draft,
            draft_pool=self.draft_pool,
            draft_is_prefix=bool(self.draft) and shares_target_layers(self.draft, self.runner),
        )
        keys = ("requests", "failed", "overloaded", "loop_errors", "batches")
        self.counters = dict.fromkeys(keys, 0)
        self._cond = threading.Condition()
        self._jobs: dict[int, _Job] = {}  # room -> job, until on_done ran
        # room -> (its pages of every entry, its lease in a cached pool), until its release
        self._room_pages: dict[int, tuple[dict[str, list[int]], Lease | None]] = {}
        self._ready: deque[int] = deque()  # registered rooms, in registration order
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"{self.name}-compute", daemon=True)
        self._thread.start()

    # ---- public API (any thread) -------------------------------------------------------------
    def submit(self, req: StageRequest, on_done: Callable[[PrefillResult], None] | None = None):
        """Queue a request; its compute starts once decode registered its pages. Raises
        ValueError (never runnable as it is, or its room id is in use) or Overloaded."""
        self.check(req)
        with self._cond:
            if self._stop:
                raise Overloaded(f"{self.name} is shutting down")
            if req.room in self._jobs:
                raise ValueError(f"room {req.room} is already in use")
            if len(self._jobs) >= self.params.max_queue:
                self.counters["overloaded"] += 1
                raise Overloaded(f"{self.name} holds {len(self._jobs)} requests (max_queue)")
            self._jobs[req.room] = _Job(req, on_done)
            self.counters["requests"] += 1
        try:
            self.sender.expect(req.room, len(req.prompt_ids), self._registered, self._released)
        except Exception as e:
            with self._cond:
                self._jobs.pop(req.room, None)
            if isinstance(e, KeyError):
                raise ValueError(f"room {req.room} is already in use") from None
            raise

    def check(self, req: StageRequest) -> None:
        """InvalidRequest for a request this stage can never run."""
        if not req.prompt_ids:
            raise InvalidRequest("prompt is empty")
        for _, pool in self._pools():
            n = pool.pages_needed(len(req.prompt_ids))
            if n > pool.num_pages:
                what = pool.layout.role
                raise InvalidRequest(
                    f"prompt needs {n} {what} KV pages but the prefill {what} pool has"
                    f" {pool.num_pages} (raise num_pages)"
                )

    def idle(self) -> bool:
        """No request held and no KV still moving."""
        with self._cond:
            return not self._jobs and not self._room_pages

    @property
    def queued(self) -> int:
        with self._cond:
            return sum(j.state < JobState.COMPUTING for j in self._jobs.values())

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens waiting (what a router balances on)."""
        with self._cond:
            return sum(
                len(j.req.prompt_ids) for j in self._jobs.values() if j.state < JobState.DONE
            )

    @property
    def pages_in_use(self) -> int:
        """Pages allocated in the target pool plus the draft pool (when there is one)."""
        return sum(p.pages_in_use for _, p in self._pools())

    def stats(self) -> dict:
        snap = self.sender.stats()
        sender_errors = snap.get("loop_errors", 0)
        with self._cond:
            snap.update(self.counters)
        snap["loop_errors"] += sender_errors
        snap["waiting"] = self.queued
        snap["queued_tokens"] = self.queued_tokens
        snap["pages_in_use"] = self.pages_in_use
        snap["num_pages"] = sum(p.num_pages for _, p in self._pools())
        snap.update(cache_stats(self.cache))
        return snap

    def room_stats(self, room: int) -> dict | None:
        return self.sender.stats_for(room)

    def close(self, drain_s: float = DRAIN_S, join_s: float = JOIN_S) -> None:
        """Stop the compute thread: the batch it runs may finish its forward, for at most
        ``join_s`` seconds. Then every request not yet answered gets a final error and its room
        is aborted (pages freed, decode told). KV already computed keeps moving to its decode
        for at most ``drain_s`` seconds (a model reload or a server stop does not cut the
        transfers of requests prefill answered); then the sender and the ranks close. A compute
        thread still in its forward after ``join_s`` (a hung kernel or rank) still uses them:
        they stay open (an error is logged) and go with the process."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        stuck = not stopped(self._thread, join_s, self.name, "the KV sender and the ranks")
        with self._cond:
            aborted = list(self._jobs)
        for room in aborted:
            self.sender.abort(room, "prefill instance shutting down")
            self._done(room, PrefillResult(room, error="prefill instance shutting down"))
        end = time.monotonic() + drain_s
        while not self._drained(aborted) and time.monotonic() < end:
            with self._cond:
                self._cond.wait(0.05)  # a release notifies
        with self._cond:
            left = len(self._room_pages)
        if left:
            log.warning(
                "%s: %d transfers still in flight after %gs; closing", self.name, left, drain_s
            )
        if self.kv_events is not None:
            self.kv_events.close()
        if not stuck:
            self.sender.close()
            close_ranks([self.runner, self.draft], self.agents)

    def _drained(self, aborted: list[int]) -> bool:
        """No KV still moving, and every room ``aborted`` ended (its Fail went to decode)."""
        with self._cond:
            if self._room_pages:
                return False
        return not any(self.sender.is_live(room) for room in aborted)

    # ---- control thread callbacks --------------------------------------------------------------
    def _registered(self, room: int) -> None:
        with self._cond:
            job = self._jobs.get(room)
            if job is not None and job.state == JobState.WAITING:
                job.state = JobState.READY
                self._ready.append(room)
                self._cond.notify_all()

    def _released(self, room: int, status: RoomStatus) -> None:
        """The room ended and no write reads its pages: free them; a request that never
        reached the compute thread ends here."""
        with self._cond:
            job = self._jobs.get(room)
            pages, lease = self._room_pages.pop(room, ({}, None))
            not_started = job is not None and job.state < JobState.COMPUTING
            self._cond.notify_all()  # close() may be draining
        self._free(pages, lease)
        if self.trace.enabled:
            st = self.sender.stats_for(room)
            if st is not None:
                self.trace.write(
                    {"stage": "prefill-transfer", "room": room, "groups": st["groups"]}
                )
        if not_started:
            reason = self.sender.failure_reason(room) or status.name
            self._done(room, PrefillResult(room, error=f"prefill did not run: {reason}"))

    def _done(self, room: int, res: PrefillResult) -> None:
        with self._cond:
            job = self._jobs.pop(room, None)
            if job is None or job.state == JobState.DONE:
                return
            job.state = JobState.DONE
        if job.on_done is not None:
            try:
                job.on_done(res)
            except Exception:
                log.exception("%s: room %d: on_done failed", self.name, room)

    # ---- compute thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop:
            try:
                self._next_batch()
            except Exception:  # never kills the thread (a batch's own errors end its rooms)
                self.counters["loop_errors"] += 1
                log.exception("%s: compute loop iteration failed", self.name)
                time.sleep(0.01)

    def _next_batch(self) -> None:
        with self._cond:
            while not self._ready and not self._stop:
                self._cond.wait(0.5)
            if self._stop:
                return
            gather(self._cond, self._burst, self._batch_tokens, self._gather_s)
            rooms = take(self._ready, self._ready_tokens, self._batch_tokens)
            jobs = [self._jobs[r] for r in rooms]
            for job in jobs:
                job.state = JobState.COMPUTING
        try:
            results = self._compute_jobs(jobs)
        except Exception as e:
            self.counters["loop_errors"] += 1
            log.exception("%s: rooms %s: unexpected error", self.name, rooms)
            results = self._abort_taken(jobs, f"prefill failed: internal error ({e})")
        for res in results:
            self._done(res.room, res)

    def _abort_taken(self, jobs: list[_Job], error: str) -> list[PrefillResult]:
        """A batch raised: abort each room it took and did not put back in the queue (the
        release callback frees its pages; decode hears Fail as soon as no write of the room is
        in flight, not after ``transfer_timeout_s``) -> their results."""
        with self._cond:
            taken = [j.req.room for j in jobs if j.state == JobState.COMPUTING]
        for room in taken:
            self.sender.abort(room, error)
        return [PrefillResult(room, error=error) for room in taken]

    def _burst(self, now: float) -> tuple[int, bool]:
        """Holds ``_cond``: (ready prompt tokens, more rooms on their way: submitted within
        ``prefill_gather_ms`` and not registered by decode yet)."""
        arriving = any(
            j.state == JobState.WAITING and now - j.queued_at < self._gather_s
            for j in self._jobs.values()
        )
        return sum(self._ready_tokens(r) or 0 for r in self._ready), arriving and not self._stop

    def _ready_tokens(self, room: int) -> int | None:
        """A ready room's prompt tokens (None: no longer ready). Holds ``_cond``."""
        job = self._jobs.get(room)
        return len(job.req.prompt_ids) if job and job.state == JobState.READY else None

    def _compute_jobs(self, jobs: list[_Job]) -> list[PrefillResult]:
        """Start every room of the batch (pages, ``start_room``) and run it as one forward.
        A room whose pages are not free at once goes back to the front of the queue (only the
        batch's first room waits for pages, as a single room always did)."""
        now = time.monotonic()
        members, results = [], []
        for i, job in enumerate(jobs):
            req = job.req
            if i and not self._pages_free(req.prompt_ids):
                self._requeue(jobs[i:])
                break
            self.latency.observe("queue", now - job.queued_at)
            m = Member(req, {}, {"start": time.time()})
            try:
                if not self.sender.is_live(req.room):
                    raise RoomGone("the room ended before prefill started it")
                m.pages, m.lease = self._alloc_pages(req.prompt_ids)
                with self._cond:  # freed by _released, exactly once
                    self._room_pages[req.room] = (m.pages, m.lease)
                try:
                    self.sender.start_room(req.room, m.pages)
                except Exception:  # whoever pops the entry frees the pages: exactly once
                    with self._cond:
                        self._free(*self._room_pages.pop(req.room, ({}, None)))
                    raise
                members.append(m)
            except Exception as e:
                m.error = e
                results.append(self._result(m))
        if members:
            self.counters["batches"] += 1
            compute(self.batch, members)
        return results + [self._result(m) for m in members]

    def _requeue(self, jobs: list[_Job]) -> None:
        with self._cond:
            for job in reversed(jobs):
                job.state = JobState.READY
                self._ready.appendleft(job.req.room)

    def _pages_free(self, prompt: list[int]) -> bool:
        n = len(prompt)
        if self.cache is not None and not self.cache.fits(prompt, self.pool.pages_needed(n)):
            return False
        return all(
            pool.num_free >= pool.pages_needed(n)
            for role, pool in self._pools()
            if role != "target" or self.cache is None
        )

    def prefill_one(self, req: StageRequest, groups: Groups | None = None) -> PrefillResult:
        """Prefill one request NOW on the calling thread, without waiting for decode's
        registration (tests and benchmarks; serving uses :meth:`submit`). ``groups``
        overrides the layer-group policy."""
        m = Member(req, {}, {"start": time.time()})
        self.counters["requests"] += 1
        try:
            self.check(req)
            m.pages, m.lease = self._alloc_pages(req.prompt_ids)
            pages, lease = m.pages, m.lease
            self.sender.start_room(req.room, pages, lambda room, st: self._free(pages, lease))
        except Exception as e:  # never started here (a room id in use is another's to end)
            self._free(m.pages, m.lease)
            m.error = e
            return self._result(m, ours=False)
        self.counters["batches"] += 1
        compute(self.batch, [m], groups)
        return self._result(m)

    def _result(self, m: Member, ours: bool = True) -> PrefillResult:
        """``ours``: the room is this worker's (it expected or started it): a failure aborts it."""
        res = PrefillResult(m.req.room, m.first_token, timing=m.timing)
        if m.error is not None:
            res.first_token = None
            self._failed(res, m.error, ours and not isinstance(m.error, RoomGone))
        record = {"stage": "prefill", "worker": self.name, "room": res.room, "error": res.error}
        self.trace.write({**record, **res.timing})
        return res

    def _failed(self, res: PrefillResult, e: Exception, abort: bool) -> None:
        self.counters["failed"] += 1
        res.error = f"prefill failed: {e}"
        log.warning("%s: room %d: %s", self.name, res.room, res.error)
        if abort:  # the release callback frees the pages; decode hears Fail once writes drained
            self.sender.abort(res.room, str(e))

    # ---- pages -------------------------------------------------------------------------------
    def _pools(self) -> list[tuple[str, KVPool]]:
        """Every entry a room holds pages of: the target's KV (and its recurrent layers' state
        slot, a hybrid model), the draft's KV."""
        draft = [(DRAFT, self.draft_pool)] if self.draft_pool is not None else []
        return [*pool_entries(self.pool).items(), *draft]

    def _alloc_pages(self, prompt: list[int]) -> tuple[dict[str, list[int]], Lease | None]:
        """Pages of every pool for the prompt, and with a prefix cache the lease of its target
        pages (its cached prefix shared: prefill computes the rest). Pages of finished rooms
        come back after their last write (release callback): wait for them, at most
        ``transfer_timeout_s``."""
        end = time.monotonic() + self.params.transfer_timeout_s
        pages: dict[str, list[int]] = {}
        lease = None
        try:
            for role, pool in self._pools():
                n = pool.pages_needed(len(prompt))
                cached = role == "target" and self.cache is not None
                while not (self.cache.fits(prompt, n) if cached else pool.num_free >= n):
                    if time.monotonic() > end:
                        raise TimeoutError(f"no {n} free prefill {role} KV pages in time")
                    time.sleep(0.005)
                if cached:
                    lease = self.cache.acquire(prompt, n)
                    pages[role] = lease.pages
                else:
                    pages[role] = pool.alloc(n)
        except Exception:
            self._free(pages, lease)
            raise
        return pages, lease

    def _free(self, pages: dict[str, list[int]], lease: Lease | None = None) -> None:
        """Give back a room's pages (its lease's, in a cached pool), exactly once."""
        for role, pool in self._pools():
            if role == "target" and lease is not None:
                lease.release()
            elif pages.get(role):
                pool.free(pages[role])
