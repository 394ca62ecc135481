"""Every wait of a rank agent and of a blocking write has an end (issue 45): a rank agent's
client keeps reading after a callback raised and fails every waiter when its pipe ends; a Send
waits for a free slot only so long; a blocking write that never ends raises WriteTimeout; the
engine unregisters memory only once its slot writers' writes ended."""

from __future__ import annotations

import threading
import time
from multiprocessing import Pipe

import msgspec
import pytest
from test_kv_engine import FakeTE

from kvtransfer.config import TransferConfig
from kvtransfer.link import engine as eng
from kvtransfer.memory.layout import Transfer
from kvtransfer.tp import agent as ag

ENC = msgspec.msgpack.Encoder()


def started_client():
    """An AgentClient over a pipe whose far end answers Start by hand."""
    near, far = Pipe()
    client = ag.AgentClient(near, rank=1)
    info = ag.AgentInfo("127.0.0.1:1", [4096], 4096, 1, b"p" * 16, {})

    def answer_start():
        far.recv_bytes()
        far.send_bytes(ENC.encode(ag.Done(0, True, info=info)))

    t = threading.Thread(target=answer_start)
    t.start()
    client.start(TransferConfig(), {"target": 0}, 1, 4096, timeout_s=10)
    t.join()
    return client, far


CHUNK = ag.Chunk(("target", 0, 1, 0, 1, 0, 0), [0], 0, 1, 0, 1)


def test_the_agent_client_survives_a_callback_that_raises():
    client, far = started_client()
    got = []

    def raises(ok, error):
        raise RuntimeError("a caller's bug")

    client.scatter(CHUNK, 0, raises)
    client.scatter(CHUNK, 0, lambda ok, error: got.append(ok))
    for seq in (1, 2):
        far.recv_bytes()
        far.send_bytes(ENC.encode(ag.Done(seq, True)))
    end = time.time() + 10
    while not got and time.time() < end:
        time.sleep(0.01)
    assert got == [True]  # the reader read on past the callback that raised
    client.close()


def test_every_waiting_command_fails_when_the_agent_is_gone():
    client, far = started_client()
    got = []
    client.scatter(CHUNK, 0, lambda ok, error: got.append((ok, error)))
    far.close()
    end = time.time() + 10
    while not got and time.time() < end:
        time.sleep(0.01)
    assert got and got[0][0] is False and "rank 1" in got[0][1]
    client.scatter(CHUNK, 0, lambda ok, error: got.append((ok, error)))
    assert got[1][0] is False  # a command after the end fails at once, never hangs


def test_a_send_waits_for_a_free_slot_only_so_long():
    pool = ag.SlotPool(1)
    assert pool.take(1.0) == 0
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="no free staging slot"):
        pool.take(0.2)
    assert time.monotonic() - t0 < 5
    pool.give(0)
    assert pool.take(0.2) == 0


class PendingTE(FakeTE):
    """Single writes stay pending until ``release`` is set."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()
        self.unregistered: list[int] = []

    def transfer_submit_write(self, session, src, dst, length):
        return 7

    def transfer_check_status(self, tid):
        return 1 if self.release.is_set() else 0

    def unregister_memory(self, addr):
        self.unregistered.append(addr)
        return 0


@pytest.fixture
def engine(monkeypatch):
    fake = PendingTE()
    monkeypatch.setattr(eng, "_load_transfer_engine", lambda: lambda: fake)
    e = eng.Engine(TransferConfig())
    yield e, fake
    fake.release.set()
    e.close()


def test_a_blocking_write_that_never_ends_raises_write_timeout(engine):
    e, _ = engine
    with pytest.raises(eng.WriteTimeout, match="not done after 0.2 s"):
        e.write_sync("peer:1", 4096, 8192, 64, timeout_s=0.2)


def test_the_engine_unregisters_memory_only_after_its_writers_stopped(engine):
    e, fake = engine
    e.register(4096, 1 << 20)
    writer, done = e.slot_writer(), []
    writer.submit("peer:1", Transfer(4096, 8192, 64), done.append)
    time.sleep(0.2)  # the write is in flight
    closer = threading.Thread(target=e.close)
    closer.start()
    time.sleep(0.5)
    assert fake.unregistered == [] and done == []  # the write still reads that memory
    fake.release.set()
    closer.join(20)
    assert done == [True] and fake.unregistered == [4096]
