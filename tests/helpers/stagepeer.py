"""A PrefillWorker in its own OS process (own Mooncake engine), driven over a pipe.

``fail_role="draft"`` makes every KV write of that entry fail (the wrapped Mooncake engine
reports the batch failed), to test how a room whose draft KV cannot be delivered ends.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading


def _fail_writes_of(worker, role: str) -> None:
    lay = worker.sender.layouts[role]
    lo, hi = lay.base_addr, lay.base_addr + lay.nbytes
    engine = worker.sender.engine
    submit = engine.submit

    def failing_submit(session, transfers, callback):
        if any(lo <= t.src < hi for t in transfers):
            callback(False)  # as when Mooncake returns a failed status for the batch
            return
        submit(session, transfers, callback)

    engine.submit = failing_submit


def _serve(conn, params_kwargs: dict, fail_role: str | None) -> None:
    os.environ.setdefault("GLOG_minloglevel", "2")
    from backends.runtime.sampler import SamplingParams
    from backends.stages.params import StageParams
    from backends.stages.prefill import PrefillWorker
    from backends.stages.request import StageRequest

    worker = PrefillWorker(StageParams(**params_kwargs))
    if fail_role:
        _fail_writes_of(worker, fail_role)
    conn.send(worker.bootstrap_addr)
    while True:
        msg = conn.recv()
        if msg is None:
            worker.close()
            return
        if msg == "pages_in_use":
            conn.send(worker.pages_in_use)
            continue
        room, ids = msg
        req = StageRequest(room=room, prompt_ids=ids, sampling=SamplingParams(max_tokens=1))
        res = worker.prefill_one(req)
        conn.send((res.first_token, res.error))


class PrefillProcess:
    def __init__(self, fail_role: str | None = None, **params_kwargs):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, params_kwargs, fail_role), daemon=True)
        self.proc.start()
        if not self.conn.poll(120):
            raise RuntimeError("prefill process did not start")
        self.addr = self.conn.recv()

    def prefill(self, room: int, ids: list[int]):
        self.conn.send((room, ids))
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
