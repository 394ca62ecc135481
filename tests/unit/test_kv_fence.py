"""Completion fences: no byte of a group leaves before the compute that wrote it has finished,
and only the transfer worker waits for that, never the thread that computes (fake Mooncake)."""

from __future__ import annotations

import threading
import time

import pytest
from test_kv_engine import FakeTE

from kvtransfer.config import TransferConfig
from kvtransfer.link import engine as eng
from kvtransfer.memory.layout import Transfer


class ManualFence:
    """A fence the test completes by hand; remembers which threads polled it."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log
        self.done = threading.Event()
        self.pollers: set[int] = set()

    def complete(self) -> None:
        self.log.append(("fence", self.name))
        self.done.set()

    def query(self) -> bool:
        self.pollers.add(threading.get_ident())
        return self.done.is_set()


class LoggingTE(FakeTE):
    def __init__(self, log: list):
        super().__init__()
        self.log = log

    def batch_transfer_async_write(self, session, srcs, dsts, lens):
        self.log.append(("write", srcs[0]))
        return super().batch_transfer_async_write(session, srcs, dsts, lens)


@pytest.fixture
def engine(monkeypatch):
    log: list = []
    fake = LoggingTE(log)
    monkeypatch.setattr(eng, "_load_transfer_engine", lambda: lambda: fake)
    e = eng.Engine(TransferConfig(max_batch_entries=4, max_inflight_entries=8))
    yield e, log
    e.close()


def submit(e, src: int, fence, results: dict, n: int = 6):
    ts = [Transfer(src + i, 10_000 + src + i, 8) for i in range(n)]  # 2 batches of 4 + 2
    e.submit("peer:1", ts, lambda ok: results.__setitem__(src, ok), fence)


def test_no_write_before_its_fence_and_the_compute_thread_never_waits(engine):
    e, log = engine
    results: dict = {}
    fences = [ManualFence(f"g{i}", log) for i in range(3)]
    t0 = time.monotonic()
    for i, f in enumerate(fences):  # the "compute thread" hands over three groups
        submit(e, 100 * (i + 1), f, results)
    assert time.monotonic() - t0 < 0.5  # handing over never waits for a fence
    time.sleep(0.2)
    assert [x for x in log if x[0] == "write"] == []  # nothing left before its fence
    fences[0].complete()
    fences[2].complete()  # completes early, but its group is behind g1 (FIFO)
    _wait(lambda: 100 in results)
    time.sleep(0.1)
    assert not any(x == ("write", 300) for x in log)
    fences[1].complete()
    _wait(lambda: len(results) == 3)
    assert results == {100: True, 200: True, 300: True}
    # every write of a group comes after its fence completed
    for i in range(3):
        f_at = log.index(("fence", f"g{i}"))
        w_at = [k for k, x in enumerate(log) if x[0] == "write" and x[1] // 100 == i + 1]
        assert w_at and min(w_at) > f_at, (i, log)
    me = threading.get_ident()
    assert all(f.pollers and me not in f.pollers for f in fences)


def test_a_fence_that_fails_fails_its_job_only(engine):
    e, log = engine
    results: dict = {}

    class Broken:
        def query(self):
            raise RuntimeError("device lost")

    submit(e, 100, Broken(), results)
    submit(e, 200, None, results)  # no fence (CPU): goes at once
    _wait(lambda: len(results) == 2)
    assert results == {100: False, 200: True}
    assert not any(x == ("write", 100) for x in log)


def _wait(cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)
