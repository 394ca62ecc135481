"""Prefill stage core (no Triton): run prompts layer group by layer group, stream KV to decode.

One :class:`PrefillWorker` per prefill instance owns the model runner, its KV pool, a
:class:`~kvtransfer.KVSender` (bootstrap endpoint ``bootstrap_addr``), the layer-group policy,
and ONE compute thread fed by a queue (:meth:`PrefillWorker.submit`). Per request: allocate
pages, ``start_room`` (claims decode's registration whenever it arrives), run the prompt group
by group calling ``send_group`` after each, sample the first token with the request's sampling
parameters, ``finish``. The sender's release callback frees the pages once the room ended and
no write reads them any more; on an error the room is aborted (decode sees Failed) and the
pages are freed the same way, exactly once.

With ``spec_enabled`` (:mod:`.draft`) the worker also holds the draft model and a draft KV pool:
after the target's groups it runs the draft over the prompt (a self-draft's KV is copied from
the target's first layers instead) and sends those pages as the room's ``draft`` entry;
``finish`` completes the room only after both entries landed.

How decode learns the address: the prefill Triton model answers every request at once with
the request carrying ``bootstrap_addr`` (before computing), and decode registers there.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtransfer import KVSender

from ..runtime.device import record_fence, resolve_device
from ..runtime.kv_pool import KVPool
from ..runtime.runner import ModelRunner
from ..runtime.sampler import sample
from .draft import DRAFT, copy_prefix_kv, load_stage_draft, make_draft_pool, shares_target_layers
from .params import StageParams
from .request import StageRequest
from .trace import TraceWriter

log = logging.getLogger(__name__)

Groups = list[tuple[int, int]]


@dataclass
class PrefillResult:
    room: int
    first_token: int | None = None
    error: str | None = None
    timing: dict = field(default_factory=dict)


class PrefillWorker:
    def __init__(
        self,
        params: StageParams,
        runner: ModelRunner | None = None,
        instance_index: int = 0,
        name: str = "prefill",
    ):
        self.params = params
        self.runner = runner or ModelRunner.load(
            params.model_path, dtype=params.dtype, device=resolve_device(params.device)
        )
        self.pool: KVPool = self.runner.make_pool(params.num_pages, params.page_size)
        self.draft = load_stage_draft(params, self.runner)  # None: speculative decoding off
        self.draft_pool = make_draft_pool(params, self.draft) if self.draft else None
        self.draft_is_prefix = bool(self.draft) and shares_target_layers(self.draft, self.runner)
        self.policy = params.policy()
        self.sender = KVSender(
            params.transfer_config(instance_index),
            {role: pool.layout for role, pool in self._pools()},
        )
        self.bootstrap_addr = self.sender.bootstrap_addr
        self.name = f"{name}{instance_index}"
        self.trace = TraceWriter(params.trace_dir, self.name)
        # completion fence of the work queued so far on the compute stream (None on CPU); the
        # sender's transfer worker waits on it, never this worker's compute thread
        self.record_fence = lambda: record_fence(self.runner.device)
        self._freed = threading.Condition()
        self.counters = {"requests": 0, "failed": 0}
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"{self.name}-compute", daemon=True)
        self._thread.start()

    # ---- public API (any thread) -------------------------------------------------------------
    def submit(self, req: StageRequest, on_done: Callable[[PrefillResult], None] | None = None):
        """Queue a request for the compute thread; ``on_done(result)`` runs there when the
        request's KV has been handed to the sender (or it failed)."""
        self._queue.put((req, on_done))

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    @property
    def pages_in_use(self) -> int:
        """Pages allocated in the target pool plus the draft pool (when there is one)."""
        return sum(p.num_pages - p.num_free for _, p in self._pools())

    def stats(self) -> dict:
        snap = self.sender.stats()
        snap.update(self.counters)
        snap["waiting"] = self.queued
        snap["pages_in_use"] = self.pages_in_use
        snap["num_pages"] = sum(p.num_pages for _, p in self._pools())
        return snap

    def room_stats(self, room: int) -> dict | None:
        return self.sender.stats_for(room)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)
        self.sender.close()

    # ---- compute thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            req, on_done = item
            res = self.prefill_one(req)  # never raises: errors are in the result
            if on_done is not None:
                try:
                    on_done(res)
                except Exception:
                    log.exception("%s: room %d: on_done failed", self.name, req.room)

    def prefill_one(self, req: StageRequest, groups: Groups | None = None) -> PrefillResult:
        """Prefill one request on the calling thread (the compute thread, or a test's).
        ``groups`` overrides the layer-group policy (benchmarks sweep it)."""
        res = PrefillResult(req.room)
        res.timing["start"] = time.time()
        self.counters["requests"] += 1
        pages: dict[str, list[int]] = {}
        started = False
        try:
            if not req.prompt_ids:
                raise ValueError("prompt is empty")
            for role, pool in self._pools():
                n = pool.pages_needed(len(req.prompt_ids))
                pages[role] = self._alloc(pool, n, self.params.transfer_timeout_s)
            self.sender.start_room(req.room, pages, self._releaser(pages))
            started = True
            res.first_token = self._compute(req, pages, groups, res.timing)
            self.sender.finish(req.room, res.first_token)
        except Exception as e:  # one request fails, the stage keeps serving
            self.counters["failed"] += 1
            res.error = f"prefill failed: {e}"
            log.warning("%s: room %d: %s", self.name, req.room, res.error)
            self._fail_room(req.room, pages, started, str(e))
        self.trace.write({"stage": "prefill", "worker": self.name, "room": req.room,
                          "error": res.error, **res.timing})  # fmt: skip
        return res

    def _compute(self, req: StageRequest, pages: dict, groups: Groups | None, t: dict) -> int:
        """Target layer groups (each handed to the sender as it is done), first token, draft."""
        groups = groups or self.policy.groups(len(req.prompt_ids), self.runner.config.num_layers)
        t["groups"] = []

        def on_group(a: int, b: int) -> None:  # layers [a, b) are launched: fence, hand over
            t["groups"].append([a, b, time.time()])
            self.sender.send_group(req.room, "target", range(a, b), self.record_fence())

        logits = self.runner.prefill(
            self.pool, req.prompt_ids, pages["target"], groups=groups, on_group=on_group
        )  # [vocab]
        gen = req.sampling.make_generator(self.runner.device)
        first = sample(logits[None], [req.sampling], [gen])[0]
        t["computed"] = time.time()
        if self.draft is not None:  # the draft's prompt KV: computed here, sent as entry 2
            if self.draft_is_prefix:
                copy_prefix_kv(self.pool, pages["target"], self.draft_pool, pages[DRAFT])
            else:
                self.draft.prefill(self.draft_pool, req.prompt_ids, pages[DRAFT])
            layers = range(self.draft.config.num_layers)
            self.sender.send_group(req.room, DRAFT, layers, self.record_fence())
            t["draft_computed"] = time.time()
        return first

    def _fail_room(self, room: int, pages: dict, started: bool, reason: str) -> None:
        if not started:
            self._free(pages)
            try:  # take the room (no pages) so decode's registration gets the Fail
                self.sender.start_room(room, {"target": []}, lambda room, st: None)
            except Exception:
                log.exception("%s: room %d: could not fail the room", self.name, room)
        self.sender.abort(room, reason)  # the release callback frees the pages

    # ---- pages -------------------------------------------------------------------------------
    def _pools(self) -> list[tuple[str, KVPool]]:
        pools = [("target", self.pool)]
        if self.draft_pool is not None:
            pools.append((DRAFT, self.draft_pool))
        return pools

    def _alloc(self, pool: KVPool, n: int, timeout: float) -> list[int]:
        """Pages of finished rooms come back asynchronously (after their last write): wait."""
        what = pool.layout.role
        if n > pool.num_pages:
            raise ValueError(
                f"prompt needs {n} {what} KV pages but the prefill {what} pool has"
                f" {pool.num_pages} (raise num_pages)"
            )
        end = time.monotonic() + timeout
        with self._freed:
            while pool.num_free < n:
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no {n} free prefill {what} KV pages within {timeout:g}s")
                self._freed.wait(min(left, 0.5))
            return pool.alloc(n)

    def _free(self, pages: dict[str, list[int]]) -> None:
        for role, pool in self._pools():
            pool.free(pages.get(role, []))

    def _releaser(self, pages: dict[str, list[int]]):
        def on_release(room, status) -> None:  # control thread: be quick
            self._free(pages)
            with self._freed:
                self._freed.notify_all()
            st = self.sender.stats_for(room) if self.trace.enabled else None
            if st is not None:
                self.trace.write(
                    {"stage": "prefill-transfer", "room": room, "groups": st["groups"]}
                )

        return on_release
