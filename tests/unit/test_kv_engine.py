"""The Mooncake wrapper's batching and completion accounting, against a fake engine."""

import threading

import pytest

from kvtransfer.config import TransferConfig
from kvtransfer.link import engine as eng
from kvtransfer.memory.layout import Transfer


class FakeTE:
    def __init__(self, fail_batch: int | None = None):
        self.fail_batch = fail_batch
        self.next_id = 1
        self.open: dict[int, int] = {}  # batch id -> entries
        self.max_open_entries = 0
        self.sizes: list[int] = []
        self.written: list[Transfer] = []
        self.regions: list[tuple[int, int]] = []

    def initialize(self, host, meta, proto, dev):
        return 0

    def get_rpc_port(self):
        return 4242

    def register_memory(self, addr, length):
        self.regions.append((addr, length))
        return 0

    def unregister_memory(self, addr):
        return 0

    def batch_transfer_async_write(self, session, srcs, dsts, lens):
        bid = self.next_id
        self.next_id += 1
        self.open[bid] = len(srcs)
        self.sizes.append(len(srcs))
        self.max_open_entries = max(self.max_open_entries, sum(self.open.values()))
        self.written += [Transfer(*t) for t in zip(srcs, dsts, lens, strict=True)]
        return bid

    def get_batch_transfer_status(self, ids):
        (bid,) = ids
        del self.open[bid]
        return -1 if bid == self.fail_batch else 0


@pytest.fixture
def make(monkeypatch):
    engines = []

    def build(fake, **cfg):
        monkeypatch.setattr(eng, "_load_transfer_engine", lambda: lambda: fake)
        e = eng.Engine(TransferConfig(**cfg))
        engines.append(e)
        return e

    yield build
    for e in engines:
        e.close()


def run(e, transfers):
    done, results = threading.Event(), []
    e.submit("peer:1", transfers, lambda ok: (results.append(ok), done.set()))
    assert done.wait(10)
    return results


@pytest.mark.parametrize("inflight", [16, 40])
def test_job_reports_once_after_its_last_batch(make, inflight):
    fake = FakeTE()
    e = make(fake, max_batch_entries=16, max_inflight_entries=inflight)
    assert e.session_id == "127.0.0.1:4242"
    ts = [Transfer(i, 1000 + i, 8) for i in range(100)]
    assert run(e, ts) == [True]
    assert fake.written == ts and max(fake.sizes) == 16 and len(fake.sizes) == 7
    assert fake.max_open_entries <= inflight and not fake.open


def test_failed_batch_fails_the_job_once_and_stops_it(make):
    fake = FakeTE(fail_batch=2)
    e = make(fake, max_batch_entries=16, max_inflight_entries=16)
    assert run(e, [Transfer(i, i, 8) for i in range(100)]) == [False]
    assert len(fake.sizes) == 2  # nothing more of that job after the failure
    assert run(e, [Transfer(1, 1, 8)]) == [True]  # the engine keeps serving


def test_register_once_and_setup_errors(make, monkeypatch):
    fake = FakeTE()
    e = make(fake)
    e.register(4096, 100)
    e.register(4096, 100)
    assert fake.regions == [(4096, 100)]
    with pytest.raises(eng.EngineError, match="another length"):
        e.register(4096, 200)
    fake.register_memory = lambda a, n: -1
    with pytest.raises(eng.EngineError, match="register_memory"):
        e.register(8192, 10)
    bad = FakeTE()
    bad.initialize = lambda *a: -1
    with pytest.raises(eng.EngineError, match="initialize"):
        make(bad)


def test_missing_mooncake_gives_install_hint(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_mooncake(name, *a, **kw):
        if name.startswith("mooncake"):
            raise ImportError("No module named 'mooncake'")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_mooncake)
    with pytest.raises(eng.EngineError, match="pip install mooncake-transfer-engine"):
        eng._load_transfer_engine()


class RaisingTE(FakeTE):
    """Raises like the real binding does for a bad address (TypeError) or a broken peer."""

    def __init__(self, raise_on: str):
        super().__init__()
        self.raise_on = raise_on

    def batch_transfer_async_write(self, session, srcs, dsts, lens):
        if self.raise_on == "submit" and session == "bad:1":
            raise TypeError("incompatible function arguments")
        return super().batch_transfer_async_write(session, srcs, dsts, lens)

    def get_batch_transfer_status(self, ids):
        if self.raise_on == "status" and self.written and self.written[-1].src == 666:
            del self.open[ids[0]]
            raise RuntimeError("transport error")
        return super().get_batch_transfer_status(ids)


@pytest.mark.parametrize("raise_on", ["submit", "status"])
def test_a_raising_mooncake_call_fails_that_job_only(make, raise_on):
    fake = RaisingTE(raise_on)
    e = make(fake)
    done, results = threading.Event(), []
    bad = [Transfer(666, 1, 8)]
    session = "bad:1" if raise_on == "submit" else "peer:1"
    e.submit(session, bad, lambda ok: (results.append(ok), done.set()))
    assert done.wait(10) and results == [False]
    assert run(e, [Transfer(1, 1, 8)]) == [True]  # the worker lives on and serves the next job
    assert e.worker_errors == 0  # handled where it happened, not by a worker restart


def test_a_callback_that_raises_does_not_stop_the_worker(make):
    e = make(FakeTE())
    e.submit("peer:1", [Transfer(1, 1, 8)], lambda ok: 1 / 0)
    assert run(e, [Transfer(2, 2, 8)]) == [True]


def test_a_job_whose_room_ended_while_queued_sends_nothing(make):
    fake = FakeTE()
    e = make(fake)
    done, results = threading.Event(), []
    e.submit(
        "peer:1",
        [Transfer(7, 7, 8)],
        lambda ok: (results.append(ok), done.set()),
        None,
        lambda: False,
    )
    assert done.wait(10) and results == [False]
    assert fake.written == []  # not one byte of an ended room goes out
