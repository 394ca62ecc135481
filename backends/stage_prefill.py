"""Prefill stage core (no Triton): run prompts layer group by layer group, stream KV to decode.

One :class:`PrefillWorker` per prefill instance owns the model runner, its KV pool, a
:class:`~kvtransfer.KVSender` (bootstrap endpoint ``bootstrap_addr``) and the layer-group
policy. Per request: allocate pages, ``start_room`` (claims decode's registration whenever it
arrives), run the prompt group by group calling ``send_group`` after each, sample the first
token with the request's sampling parameters, ``finish``. The sender's release callback frees
the pages once the room ended and no write reads them any more; on an error the room is aborted
(decode sees Failed) and the pages are freed the same way, exactly once.

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
        self.policy = params.policy()
        self.sender = KVSender(params.transfer_config(instance_index), {"target": self.pool.layout})
        self.bootstrap_addr = self.sender.bootstrap_addr
        self.name = f"{name}{instance_index}"
        self._freed = threading.Condition()
        self.counters = {"requests": 0, "failed": 0, "prompt_tokens": 0, "groups": 0}
        self._trace_lock = threading.Lock()

    # ---- pages -------------------------------------------------------------------------------
    @property
    def pages_in_use(self) -> int:
        return self.pool.num_pages - self.pool.num_free

    def _alloc(self, n: int, timeout: float) -> list[int]:
        """Pages of finished rooms come back asynchronously (after their last write): wait."""
        if n > self.pool.num_pages:
            raise ValueError(
                f"prompt needs {n} KV pages but the prefill pool has {self.pool.num_pages}"
                " (raise num_pages)"
            )
        end = time.monotonic() + timeout
        with self._freed:
            while self.pool.num_free < n:
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no {n} free prefill KV pages within {timeout:g}s")
                self._freed.wait(min(left, 0.5))
            return self.pool.alloc(n)

    def _releaser(self, pages: list[int]):
        def on_release(room, status) -> None:  # control thread: be quick
            self.pool.free(pages)
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
        pages: list[int] | None = None
        started = False
        try:
            if not req.prompt_ids:
                raise ValueError("prompt is empty")
            n = self.pool.pages_needed(len(req.prompt_ids))
            pages = self._alloc(n, self.params.transfer_timeout_s)
            self.sender.start_room(req.room, {"target": pages}, self._releaser(pages))
            started = True
            layers = self.runner.config.num_layers
            groups = self.policy.groups(len(req.prompt_ids), layers)
            t["groups"] = []

            def on_group(a: int, b: int) -> None:
                t["groups"].append([a, b, time.time()])
                self.sender.send_group(req.room, "target", range(a, b))

            logits = self.runner.prefill(
                self.pool, req.prompt_ids, pages, groups=groups, on_group=on_group
            )  # [vocab]
            gen = req.params.make_generator(self.runner.device)
            res.first_token = sample(logits[None], [req.params], [gen])[0]
            t["computed"] = time.time()
            self.sender.finish(req.room, res.first_token)
            self.counters["prompt_tokens"] += len(req.prompt_ids)
            self.counters["groups"] += len(groups)
        except Exception as e:  # one request fails, the stage keeps serving
            self.counters["failed"] += 1
            res.error = f"prefill failed: {e}"
            log.warning("%s: room %d: %s", self.name, req.room, res.error)
            if not started:
                if pages is not None:
                    self.pool.free(pages)
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
        return snap

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
