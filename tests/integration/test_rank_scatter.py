"""A tensor-parallel decode's rank 1 scatters slowly (a real KVReceiver with its Mooncake engine;
rank 1 is a scripted agent that answers only when the test says; prefill is scripted by hand).

While rank 1 holds a scatter, decode's control thread keeps serving other rooms; the room's
Complete is acted on only after the scatter was answered; a room that fails meanwhile keeps its
pages (and slots) until the scatter ended, so a late scatter never lands in pages that another
room owns."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from kvpeer import LAYOUTS
from scripted_prefill import ScriptedPrefill, receiver_config

from kvtransfer import EntryLayout, KVReceiver, RoomStatus
from kvtransfer import messages as m

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SECRET = b"rank-scatter-secret-0123456789ab"
PAGE, POOL, TOKENS = 16, 64, 40  # 3 pages


class SlowRank:
    """Decode rank 1's agent, as KVReceiver sees it: its shard, its slots, and scatters that end
    only when :meth:`answer` is called."""

    def __init__(self, lay: EntryLayout):
        self.lay = lay
        self.buf = np.zeros(lay.nbytes, np.uint8)
        self.slots = np.zeros(4 * lay.page_bytes * 2, np.uint8)
        slot_bytes = 2 * lay.page_bytes
        addrs = [self.slots.ctypes.data + i * slot_bytes for i in range(2)]
        self.info = SimpleNamespace(
            session_id="127.0.0.1:1",
            proof_addr=1,
            proof=b"p" * 16,
            slot_addrs=addrs,
            slot_bytes=slot_bytes,
        )
        self.held: list = []  # (chunk, slot, done) not answered yet
        self.arrived = threading.Event()

    def layouts(self) -> dict[str, EntryLayout]:
        return {"target": self.lay.with_pool(POOL, self.buf.ctypes.data)}

    def scatter(self, chunk, slot, done) -> None:
        self.held.append((chunk, slot, done))
        self.arrived.set()

    def answer(self, ok: bool = True) -> None:
        for _, _, done in self.held:
            done(ok, "" if ok else "scatter failed")
        self.held.clear()


@pytest.fixture
def setup():
    full = EntryLayout(role="target", page_size=PAGE, num_pages=POOL, **LAYOUTS["gqa"])
    rank0 = replace(full, kv_heads=1, head_start=0, total_kv_heads=2)
    rank1 = replace(full, kv_heads=1, head_start=1, total_kv_heads=2)
    buf = np.zeros(rank0.nbytes, np.uint8)
    rank0 = rank0.with_pool(POOL, buf.ctypes.data)
    cfg = receiver_config(SECRET, 2 * rank0.page_bytes, slots=2, grants=1)
    slow = SlowRank(rank1)
    rx = KVReceiver(cfg, {"target": rank0}, {"target": torch.from_numpy(buf)}, [slow])
    peer = ScriptedPrefill(SECRET)
    yield rank0, rx, slow, peer
    slow.answer(False)
    peer.close()
    rx.close()






def staged_on_rank_1(lay, rx, peer, room, released):
    """Register ``room``, claim it, and land one chunk in rank 1's lent slot: rank 1 now holds
    its scatter. Returns prefill's connection identity."""
    cb = lambda r, s: released.setdefault(r, []).append(s.name)  # noqa: E731
    rx.register(room, [peer.addr], {"target": [5, 9, 2]}, TOKENS, cb)
    ident, reg = peer.recv(m.Register)
    assert len(reg.ranks) == 1 and reg.ranks[0].heads == {"target": [1, 1]}
    peer.send(ident, m.Ack(room, {"target": lay.signature()}))
    peer.send(ident, m.Want(room, 1, 1))
    _, grant = peer.recv(m.Grant)
    assert grant.rank == 1
    peer.send(ident, m.Staged(room, grant.slot, "target", 0, 2, 0, 2, 1, 0, 0))
    return ident


def test_a_slow_rank_scatter_never_blocks_the_control_thread_and_defers_complete(setup):
    lay, rx, slow, peer = setup
    released: dict[int, list[str]] = {}
    ident = staged_on_rank_1(lay, rx, peer, 7, released)
    assert slow.arrived.wait(10)
    t0 = time.monotonic()
    rx.register(8, [peer.addr], {"target": [11, 12, 13]}, TOKENS, lambda r, s: None)  # served now
    assert time.monotonic() - t0 < 5
    peer.recv(m.Register)
    peer.send(ident, m.Complete(7, 42, {}, {}))
    time.sleep(0.5)
    assert rx.poll(7) == RoomStatus.WaitingForInput  # not before rank 1 scattered its chunk
    slow.answer(True)
    assert rx.wait(7, 10) == RoomStatus.Success
    assert rx.result(7) == (42, {})
    assert released == {7: ["Success"]}


def test_a_room_that_fails_keeps_its_pages_until_its_rank_scatter_ended(setup):
    lay, rx, slow, peer = setup
    released: dict[int, list[str]] = {}
    ident = staged_on_rank_1(lay, rx, peer, 9, released)
    assert slow.arrived.wait(10)
    peer.send(ident, m.Fail(9, "prefill gave up"))  # its writes drained: no quarantine
    time.sleep(0.5)
    assert rx.poll(9) == RoomStatus.Failed
    assert released == {}  # rank 1 may still write into the room's pages
    slow.answer(True)
    end = time.time() + 10
    while not released and time.time() < end:
        time.sleep(0.05)
    assert released == {9: ["Failed"]}
    assert rx.quarantined() == set()


def test_a_failed_rank_scatter_fails_only_its_room(setup):
    lay, rx, slow, peer = setup
    released: dict[int, list[str]] = {}
    staged_on_rank_1(lay, rx, peer, 11, released)
    assert slow.arrived.wait(10)
    slow.answer(False)
    assert rx.wait(11, 10) == RoomStatus.Failed
    assert "rank 1" in rx.failure_reason(11)
