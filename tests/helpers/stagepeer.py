"""A PrefillWorker in its own OS process (own Mooncake engine), driven over a pipe.

``fail_role="draft"`` makes every KV write of that entry fail (the wrapped Mooncake engine
reports the batch failed), to test how a room whose draft KV cannot be delivered ends.
``fence_delay_s=D`` gives every layer group a completion fence that completes D seconds after
the group was handed over (as a slow GPU stream would) and logs who polled it and when each
Mooncake write was submitted (``fence_log()``).
``batch_of=N`` makes the compute thread wait (at most 30 s) until N rooms are ready before it
takes a batch, so a test can have N rooms prefilled in one forward (``submit_all``);
``fail_room=R`` makes every ``send_group`` of room R raise (one room of a batch failing).
``fail_batch="first_tokens"`` makes the first batch's logprobs raise (in the batch's sampling
step), ``fail_batch="batch"`` the first batch itself (an unexpected error of the compute thread,
before the forward), ``fail_batch="take"`` the compute loop's first pick of a batch; later ones
run as usual.
``slow_forward_s=S`` makes every forward wait S seconds before it starts (and records when it
started and returned, and when the sender closed: ``close(join_s)``).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import sys
import threading
import time

from tests.helpers import peer_procs


def tiny_params(model_dir: str, num_pages: int = 64, **kw) -> dict:
    """Stage parameters of the integration tests' tiny-model stages (both sides): pages of 4
    tokens, one layer a group, a 10 s bootstrap timeout."""
    return dict(
        model_dir=model_dir, page_size=4, num_pages=num_pages, max_context=256,
        max_tokens_limit=128, lg_fixed_group_size=1, bootstrap_timeout_s=10.0, **kw,
    )  # fmt: skip


def _fail_writes_of(worker, role: str) -> None:
    lay = worker.sender.layouts[role]
    lo, hi = lay.base_addr, lay.base_addr + lay.nbytes
    engine = worker.sender.engine
    submit = engine.submit

    def failing_submit(session, transfers, callback, *args, **kwargs):
        if any(lo <= t.src < hi for t in transfers):
            callback(False)  # as when Mooncake returns a failed status for the batch
            return
        submit(session, transfers, callback, *args, **kwargs)

    engine.submit = failing_submit


class _LoggedTE:
    """Forwards to the real Mooncake engine; logs (time, lowest source address) of each write."""

    def __init__(self, te, log: dict):
        self._te, self._log = te, log

    def __getattr__(self, name):
        return getattr(self._te, name)

    def batch_transfer_async_write(self, session, srcs, dsts, lens):
        self._log["writes"].append((time.time(), min(srcs)))
        return self._te.batch_transfer_async_write(session, srcs, dsts, lens)


def _slow_fences(worker, delay: float) -> dict:
    log = {"fences": [], "pollers": [], "writes": [], "compute_thread": threading.get_ident()}
    lay = worker.pool.layout
    log["layout"] = (lay.base_addr, lay.components * lay.num_pages * lay.page_bytes)

    class SlowFence:
        def __init__(self):
            self.ready_at = time.time() + delay
            log["fences"].append(self.ready_at)

        def query(self) -> bool:
            log["pollers"].append(threading.get_ident())
            return time.time() >= self.ready_at

    worker.batch = dataclasses.replace(worker.batch, record_fence=SlowFence)
    worker.sender.engine._te = _LoggedTE(worker.sender.engine._te, log)
    return log


def _hold_batches(worker, n: int, sizes: list[int]) -> None:
    from backends.stages.prefill import worker as prefill_worker

    take = prefill_worker.take

    def held(ready, tokens_of, budget):  # called with worker._cond held; wait() releases it
        end = time.monotonic() + 30
        while len(ready) < n and time.monotonic() < end:
            worker._cond.wait(0.05)
        out = take(ready, tokens_of, budget)
        sizes.append(len(out))
        return out

    prefill_worker.take = held


def _skip_sends_of(worker, role: str) -> None:
    """Entry ``role`` never leaves prefill (its groups are dropped): what a PD that moved only
    part of a hybrid model's state would do."""
    send = worker.sender.send_group

    def all_but_role(room, r, *args, **kwargs):
        if r != role:
            send(room, r, *args, **kwargs)

    worker.sender.send_group = all_but_role


def _fail_sends_of(worker, room: int) -> None:
    send = worker.sender.send_group

    def failing(r, *args, **kwargs):
        if r == room:
            raise RuntimeError(f"injected send failure for room {r}")
        return send(r, *args, **kwargs)

    worker.sender.send_group = failing


def _fail_first_batch(where: str) -> None:
    from backends.stages.prefill import batch
    from backends.stages.prefill import worker as prefill_worker

    module, name = {
        "first_tokens": (batch, "token_logprobs"),
        "batch": (prefill_worker, "compute"),
        "take": (prefill_worker, "take"),  # the compute loop itself, before any room is taken
    }[where]
    real, calls = getattr(module, name), []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:  # a KeyError, as a bug in logprobs could raise: not a room in use
            raise KeyError(f"injected failure in {name}")
        return real(*args, **kwargs)

    setattr(module, name, failing)


def _slow_forwards(worker, delay: float, started: threading.Event) -> dict:
    log: dict = {}
    forward, close = worker.runner.prefill_batch, worker.sender.close

    def slow(*args, **kwargs):
        log["forward_started"] = time.time()
        started.set()
        time.sleep(delay)
        try:
            return forward(*args, **kwargs)
        finally:
            log["forward_returned"] = time.time()

    def logged_close():
        log["sender_closed"] = time.time()
        close()

    worker.runner.prefill_batch, worker.sender.close = slow, logged_close
    return log


def _submit(worker, reqs, results: dict) -> None:
    """Submit every (room, prompt) as serving does; ``results[room]`` = (first token, error)
    once the worker answered it."""
    from backends.runtime.sampling_params import SamplingParams
    from backends.stages.request import StageRequest

    def on_done(res):
        results[res.room] = (res.first_token, res.error)

    for room, ids in reqs:
        sp = SamplingParams(max_tokens=1)
        worker.submit(StageRequest(room=room, prompt_ids=ids, sampling=sp), on_done)


def _close(worker, join_s: float, started: threading.Event, log: dict, results: dict) -> dict:
    """Close the worker once a forward started (if one is slowed): what happened, and when."""
    started.wait(60)
    called = time.time()
    worker.close(drain_s=5.0, join_s=join_s)
    return {
        **log,
        "close_called": called,
        "close_returned": time.time(),
        "compute_alive": worker._thread.is_alive(),
        "status": {room: worker.sender.poll(room).name for room in results},
        "results": dict(results),
        "pages_in_use": worker.pages_in_use,
    }


def _submit_all(worker, reqs) -> list:
    from backends.runtime.sampling_params import SamplingParams
    from backends.stages.request import StageRequest

    results, done = {}, threading.Event()

    def on_done(res):
        results[res.room] = (res.first_token, res.error)
        if len(results) == len(reqs):
            done.set()

    for room, ids in reqs:
        sp = SamplingParams(max_tokens=1)
        worker.submit(StageRequest(room=room, prompt_ids=ids, sampling=sp), on_done)
    done.wait(120)
    return [results.get(room) for room, _ in reqs]


def _serve(conn, params_kwargs: dict, fail_role: str | None, fence_delay: float,
           batch_of: int = 0, fail_room: int | None = None, faults: dict | None = None,
           ) -> None:  # fmt: skip
    os.environ.setdefault("GLOG_minloglevel", "2")
    from backends.runtime.sampling_params import SamplingParams
    from backends.stages.params import StageParams
    from backends.stages.prefill import PrefillWorker
    from backends.stages.request import StageRequest

    worker = PrefillWorker(StageParams(**params_kwargs))
    if fail_role:
        _fail_writes_of(worker, fail_role)
    if fail_room is not None:
        _fail_sends_of(worker, fail_room)
    sizes: list[int] = []  # of every batch the compute thread took
    _hold_batches(worker, batch_of, sizes)
    log = _slow_fences(worker, fence_delay) if fence_delay else {}
    faults = faults or {}
    if faults.get("fail_batch"):
        _fail_first_batch(faults["fail_batch"])
    if faults.get("skip_role"):
        _skip_sends_of(worker, faults["skip_role"])
    started, submitted = threading.Event(), {}  # a slowed forward started; room -> result
    if faults.get("slow_forward_s"):
        log = _slow_forwards(worker, faults["slow_forward_s"], started)
    else:
        started.set()
    conn.send(worker.bootstrap_addr)
    closed = False
    while True:
        msg = conn.recv()
        if msg is None:
            if not closed:
                worker.close()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)  # closed above; the interpreter's own teardown took ~1.5 s a process
        if msg == "stats":
            conn.send(worker.stats())
            continue
        if msg[0] == "submit":
            _submit(worker, msg[1], submitted)
            conn.send(True)
            continue
        if msg[0] == "close":
            conn.send(_close(worker, msg[1], started, log, submitted))
            closed = True
            continue
        if msg == "pages_in_use":
            conn.send(worker.pages_in_use)
            continue
        if msg == "fence_log":
            conn.send({**log, "pollers": sorted(set(log["pollers"]))})
            continue
        if msg[0] == "submit_all":
            conn.send((_submit_all(worker, msg[1]), list(sizes)))
            continue
        room, ids = msg
        req = StageRequest(room=room, prompt_ids=ids, sampling=SamplingParams(max_tokens=1))
        res = worker.prefill_one(req)
        conn.send((res.first_token, res.error, res.timing))


class PrefillProcess:
    def __init__(self, fail_role: str | None = None, fence_delay_s: float = 0.0,
                 batch_of: int = 0, fail_room: int | None = None, fail_batch: str | None = None,
                 slow_forward_s: float = 0.0, skip_role: str | None = None,
                 **params_kwargs):  # fmt: skip
        self.conn, child = mp.Pipe()
        faults = dict(fail_batch=fail_batch, slow_forward_s=slow_forward_s, skip_role=skip_role)
        args = (child, params_kwargs, fail_role, fence_delay_s, batch_of, fail_room, faults)
        self.proc = peer_procs.process(_serve, args)
        self.proc.start()
        if not self.conn.poll(120):
            raise RuntimeError("prefill process did not start")
        self.addr = self.conn.recv()

    def prefill(self, room: int, ids: list[int]):
        """-> (first token, error); ``prefill_timed`` also returns the worker's timing."""
        return self.prefill_timed(room, ids)[:2]

    def prefill_timed(self, room: int, ids: list[int]):
        self.conn.send((room, ids))
        return self.conn.recv()

    def submit_all(self, reqs: list[tuple[int, list[int]]]):
        """Submit every (room, prompt) as serving does (compute once decode registered) and wait
        for all: ([(first token, error)], sizes of the batches the compute thread took)."""
        self.conn.send(("submit_all", reqs))
        return self.conn.recv()

    def submit(self, reqs: list[tuple[int, list[int]]]) -> None:
        """Submit every (room, prompt) and return at once (results: ``close``)."""
        self.conn.send(("submit", reqs))
        self.conn.recv()

    def close(self, join_s: float) -> dict:
        """Close the worker (``join_s``: its bound on the compute thread) once a slowed forward
        started: times (forward started / returned, sender closed, close called / returned),
        whether the compute thread still runs, each submitted room's status and result, and the
        pages still in use."""
        self.conn.send(("close", join_s))
        return self.conn.recv()

    def stats(self) -> dict:
        self.conn.send("stats")
        return self.conn.recv()

    def fence_log(self) -> dict:
        self.conn.send("fence_log")
        return self.conn.recv()

    def pages_in_use(self) -> int:
        self.conn.send("pages_in_use")
        return self.conn.recv()

    def stop(self) -> None:
        self.conn.send(None)
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


class Collector:
    """A DecodeWorker ``emit`` callback that keeps every event; ``done`` is set by the final."""

    def __init__(self):
        self.events, self.done = [], threading.Event()

    def __call__(self, ev):
        self.events.append(ev)
        if ev.final:
            self.done.set()

    @property
    def ids(self) -> list[int]:
        return [t for ev in self.events for t in ev.token_ids]
