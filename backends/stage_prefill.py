"""Prefill stage core (no Triton): run prompts layer group by layer group, stream KV to decode.

One :class:`PrefillWorker` per prefill instance owns the model runner, its KV pool, a
:class:`~kvtransfer.KVSender` (bootstrap endpoint ``bootstrap_addr``) and the layer-group
policy. Per request: allocate pages, ``start_room`` (claims decode's registration whenever it
arrives), run the prompt group by group calling ``send_group`` after each, sample the first
token with the request's sampling parameters, ``finish``. The sender's release callback frees
the pages once the room ended and no write reads them any more; on an error the room is aborted
(decode sees Failed) and the pages are freed the same way, exactly once.

With ``spec_enabled`` (:mod:`backends.stage_spec`) the worker also holds the draft model and a
draft KV pool: after the target's groups it runs the draft over the prompt (a self-draft's KV is
copied from the target's first layers instead) and sends those pages as the room's ``draft``
entry; ``finish`` completes the room only after both entries landed.

How decode learns the address: the prefill Triton model answers every request at once with its
``bootstrap_addr`` (before computing), and decode registers there. Direct Python users pass
``worker.bootstrap_addr`` to :class:`~backends.stage_decode.DecodeRequest` themselves.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field

from kvtransfer import KVSender

from .kv_pool import KVPool
from .runner import ModelRunner
from .sampler import SamplingParams, sample
from .stage_params import StageParams
from .stage_spec import (
    DRAFT,
    copy_prefix_kv,
    load_stage_draft,
    make_draft_pool,
    shares_target_layers,
)

log = logging.getLogger(__name__)


@dataclass
class PrefillRequest:
    room: int
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=lambda: SamplingParams(max_tokens=1))


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
            params.model_path, dtype=params.dtype, device=params.device
        )
        self.pool: KVPool = self.runner.make_pool(params.num_pages, params.page_size)
        self.draft = load_stage_draft(params, self.runner)  # None: speculative decoding off
        self.draft_pool = make_draft_pool(params, self.draft) if self.draft else None
        self.draft_is_prefix = bool(self.draft) and shares_target_layers(self.draft, self.runner)
        self.policy = params.policy()
        layouts = {"target": self.pool.layout}
        if self.draft_pool is not None:
            layouts[DRAFT] = self.draft_pool.layout
        self.sender = KVSender(params.transfer_config(instance_index), layouts)
        self.bootstrap_addr = self.sender.bootstrap_addr
        self.name = f"{name}{instance_index}"
        self._freed = threading.Condition()
        self.counters = {"requests": 0, "failed": 0, "prompt_tokens": 0, "groups": 0}
        self._trace_lock = threading.Lock()

    # ---- pages -------------------------------------------------------------------------------
    @property
    def pages_in_use(self) -> int:
        """Pages allocated in the target pool plus the draft pool (when there is one)."""
        used = self.pool.num_pages - self.pool.num_free
        if self.draft_pool is not None:
            used += self.draft_pool.num_pages - self.draft_pool.num_free
        return used

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
        self.pool.free(pages.get("target", []))
        if self.draft_pool is not None:
            self.draft_pool.free(pages.get(DRAFT, []))

    def _releaser(self, pages: dict[str, list[int]]):
        def on_release(room, status) -> None:  # control thread: be quick
            self._free(pages)
            with self._freed:
                self._freed.notify_all()
            self.trace_transfers(room)

        return on_release

    # ---- requests ----------------------------------------------------------------------------
    def prefill(self, requests: list[PrefillRequest]) -> list[PrefillResult]:
        """Run a batch of requests one after another (each streams while it computes)."""
        return [self.prefill_one(r) for r in requests]

    def prefill_one(self, req: PrefillRequest) -> PrefillResult:
        res = PrefillResult(req.room)
        t = res.timing
        t["start"] = time.time()
        self.counters["requests"] += 1
        pages: dict[str, list[int]] = {}
        started = False
        try:
            if not req.prompt_ids:
                raise ValueError("prompt is empty")
            timeout = self.params.transfer_timeout_s
            for role, pool in self._pools():
                pages[role] = self._alloc(pool, pool.pages_needed(len(req.prompt_ids)), timeout)
            self.sender.start_room(req.room, pages, self._releaser(pages))
            started = True
            layers = self.runner.config.num_layers
            groups = self.policy.groups(len(req.prompt_ids), layers)
            t["groups"] = []

            def on_group(a: int, b: int) -> None:
                t["groups"].append([a, b, time.time()])
                self.sender.send_group(req.room, "target", range(a, b))

            logits = self.runner.prefill(
                self.pool, req.prompt_ids, pages["target"], groups=groups, on_group=on_group
            )  # [vocab]
            gen = req.params.make_generator(self.runner.device)
            res.first_token = sample(logits[None], [req.params], [gen])[0]
            t["computed"] = time.time()
            if self.draft is not None:  # the draft's prompt KV: computed here, sent as entry 2
                if self.draft_is_prefix:
                    copy_prefix_kv(self.pool, pages["target"], self.draft_pool, pages[DRAFT])
                else:
                    self.draft.prefill(self.draft_pool, req.prompt_ids, pages[DRAFT])
                self.sender.send_group(req.room, DRAFT, range(self.draft.config.num_layers))
                t["draft_computed"] = time.time()
            self.sender.finish(req.room, res.first_token)
            self.counters["prompt_tokens"] += len(req.prompt_ids)
            self.counters["groups"] += len(groups)
        except Exception as e:  # one request fails, the stage keeps serving
            self.counters["failed"] += 1
            res.error = f"prefill failed: {e}"
            log.warning("%s: room %d: %s", self.name, req.room, res.error)
            if not started:
                self._free(pages)
                try:  # take the room (no pages) so decode's registration gets the Fail
                    self.sender.start_room(req.room, {"target": []}, lambda room, st: None)
                except Exception:
                    log.exception("%s: room %d: could not fail the room", self.name, req.room)
            self.sender.abort(req.room, str(e))  # the release callback frees the pages
        self._trace(res)
        return res

    def stats(self) -> dict:
        snap = self.sender.stats()
        snap.update(self.counters)
        snap["pages_in_use"] = self.pages_in_use
        snap["num_pages"] = self.pool.num_pages
        if self.draft_pool is not None:
            snap["num_pages"] += self.draft_pool.num_pages
        return snap

    def _pools(self) -> list[tuple[str, KVPool]]:
        pools = [("target", self.pool)]
        if self.draft_pool is not None:
            pools.append((DRAFT, self.draft_pool))
        return pools

    def room_stats(self, room: int) -> dict | None:
        return self.sender.stats_for(room)

    def _trace(self, res: PrefillResult) -> None:
        if not self.params.trace_dir:
            return
        rec = {"stage": "prefill", "worker": self.name, "room": res.room, "error": res.error}
        rec.update(res.timing)
        path = os.path.join(self.params.trace_dir, f"{self.name}-{os.getpid()}.jsonl")
        with self._trace_lock, open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def trace_transfers(self, room: int) -> None:
        """Append the sender's per-group transfer record of ``room`` (once it ended)."""
        if not self.params.trace_dir:
            return
        st = self.sender.stats_for(room)
        if st is None:
            return
        rec = {"stage": "prefill-transfer", "room": room, "groups": st["groups"]}
        path = os.path.join(self.params.trace_dir, f"{self.name}-{os.getpid()}.jsonl")
        with self._trace_lock, open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def close(self) -> None:
        self.sender.close()
