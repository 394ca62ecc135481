"""A hostile prefill against decode's staging (a real KVReceiver with its Mooncake engine and a
zero pool; the attacker speaks the signed control protocol by hand and fills lent slots
directly, as its one large write would). A chunk lands only in the pages decode registered for
that room; a Staged that names a slot not lent to the room, or does not fit, fails that room
only, and its pages and slots wait for the peer's drain."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvpeer import LAYOUTS
from scripted_prefill import ScriptedPrefill, receiver_config

from kvtransfer import EntryLayout, KVReceiver
from kvtransfer import messages as m
from kvtransfer.memory.layout import staging_rows

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SECRET = b"staging-hostile-secret-0123456789"
PAGE, POOL, TOKENS = 16, 64, 90  # 6 pages


@pytest.fixture
def setup():
    lay = EntryLayout(role="target", page_size=PAGE, num_pages=POOL, **LAYOUTS["gqa"])
    buf = np.zeros(lay.nbytes, np.uint8)
    lay = lay.with_pool(POOL, buf.ctypes.data)
    cfg = receiver_config(SECRET, 4 * lay.page_bytes, slots=4, grants=2)
    rx = KVReceiver(cfg, {"target": lay}, {"target": torch.from_numpy(buf)})
    peer = ScriptedPrefill(SECRET)
    released: dict[int, list[str]] = {}
    yield lay, buf, rx, peer, released
    peer.close()
    rx.close()




def claim(lay, rx, peer, room, pages, released):
    cb = lambda r, s: released.setdefault(r, []).append(s.name)  # noqa: E731
    rx.register(room, [peer.addr], {"target": pages}, TOKENS, cb)
    ident, reg = peer.recv(m.Register)
    assert reg.staging_slots == 4 and reg.staging_slot_bytes == 4 * lay.page_bytes
    peer.send(ident, m.Ack(room, {"target": lay.signature()}))
    peer.send(ident, m.Want(room, 5))
    grants = [peer.recv(m.Grant)[1] for _ in range(2)]  # capped at 2 per room
    assert {g.room for g in grants} == {room}
    return ident, reg, [g.slot for g in grants]




def test_chunk_lands_only_in_the_rooms_pages_and_bad_chunks_fail_the_room(setup):
    lay, buf, rx, peer, released = setup
    pages = [40, 3, 17, 9, 60, 22]
    ident, reg, slots = claim(lay, rx, peer, 7, pages, released)
    rx.staging.area.buffer[:] = 0xAB  # what a write of the slot would have put there
    # units 5..8 of layers [1, 3): cross the K/V boundary of layer 1
    peer.send(ident, m.Staged(7, slots[0], "target", 1, 3, 5, 4))
    _, again = peer.recv(m.Grant)  # served: the slot comes back to the same room
    assert again == m.Grant(7, slots[0])
    rows = staging_rows(lay, pages, range(1, 3), 5, 4)
    view = buf.reshape(-1, lay.page_bytes)
    assert (view[rows] == 0xAB).all()
    others = np.setdiff1d(np.arange(view.shape[0]), rows)
    assert not view[others].any()  # nothing else of the pool was touched

    # a slot that is not this room's (never lent to it): the room fails, nothing is written
    foreign = next(s for s in range(4) if s not in slots)
    peer.send(ident, m.Staged(7, foreign, "target", 0, 1, 0, 1))
    _, abort = peer.recv(m.Abort)
    assert abort.room == 7 and "not lent to this room" in abort.reason
    assert rx.poll(7).name == "Failed" and 7 not in released  # quarantined until the drain
    assert not view[others].any()
    peer.send(ident, m.Fail(7, "drained"))
    rx.wait(7, 10)
    assert released[7] == ["Failed"]


@pytest.mark.parametrize(
    "bad, why",
    [
        (dict(count=5), "do not fit one slot"),  # 5 pages > a slot of 4
        (dict(start=6 * 2 * 2 - 1, count=2), "outside the group's stream"),
        (dict(layer_stop=9), "outside [0, 4)"),
        (dict(role="draft"), "not registered"),
        # protocol 6 (tensor parallel): a head range outside the rank's shard, another rank
        (dict(heads=3), "heads [0, 3) outside the rank's 2"),
        (dict(head_off=1, heads=2), "heads [1, 3) outside the rank's 2"),
        (dict(heads=-1), "outside the rank's 2"),
        (dict(rank=1), "slot 0 of rank 1 is not lent"),
    ],
)
def test_out_of_bounds_chunks_fail_only_that_room(setup, bad, why):
    lay, buf, rx, peer, released = setup
    ident, _, slots_a = claim(lay, rx, peer, 8, [1, 2, 3, 4, 5, 6], released)
    _, _, slots_b = claim(lay, rx, peer, 9, [11, 12, 13, 14, 15, 16], released)
    rx.staging.area.buffer[:] = 0xCD
    kw = dict(room=8, slot=slots_a[0], role="target", layer_start=0, layer_stop=2, start=0)
    kw["slot"] = 0 if "rank" in bad else kw["slot"]
    kw.update(count=1, **{k: v for k, v in bad.items() if k != "count"})
    kw["count"] = bad.get("count", 1)
    peer.send(ident, m.Staged(**kw))
    _, abort = peer.recv(m.Abort)
    assert abort.room == 8 and why in abort.reason
    assert not buf.any()  # no byte anywhere
    peer.send(ident, m.Staged(9, slots_b[0], "target", 0, 4, 0, 4))  # room 9 still served
    assert peer.recv(m.Grant)[1] == m.Grant(9, slots_b[0])
    assert rx.poll(9).name != "Failed" and buf.any()


def test_a_head_slice_lands_in_those_heads_only(setup):
    """A TP prefill's chunk of head 1 (of 2) lands in head 1 of the room's rows, nothing else."""
    lay, buf, rx, peer, released = setup
    pages = [5, 33, 2, 48, 19, 7]
    ident, _, slots = claim(lay, rx, peer, 10, pages, released)
    rx.staging.area.buffer[:] = 0x5A
    peer.send(ident, m.Staged(10, slots[0], "target", 0, 2, 3, 6, 0, 1, 1))
    assert peer.recv(m.Grant)[1] == m.Grant(10, slots[0])
    rows = staging_rows(lay, pages, range(0, 2), 3, 6)
    view = buf.reshape(-1, PAGE, 2, lay.page_bytes // PAGE // 2)  # [rows, tokens, heads, bytes]
    assert (view[rows, :, 1] == 0x5A).all() and not view[rows, :, 0].any()
    others = np.setdiff1d(np.arange(view.shape[0]), rows)
    assert not view[others].any()
