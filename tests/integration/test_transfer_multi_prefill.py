"""Decode registers with several prefill instances; only the one that runs the request claims."""

import time

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

ENTRIES = {"target": ("gqa", 16, 64)}


def test_only_the_starting_prefill_claims(spawn):
    p1 = spawn("prefill", ENTRIES, seed=1, bootstrap_timeout_s=2.0)
    p2 = spawn("prefill", ENTRIES, seed=2, bootstrap_timeout_s=2.0)
    decode = spawn("decode", ENTRIES)
    addrs = [p1.info["bootstrap_addr"], p2.info["bootstrap_addr"]]
    free0 = [p.free_counts() for p in (p1, p2, decode)]
    for room, owner in [(1, p2), (2, p1)]:
        owner.alloc_pages(room, {"target": 5})
        decode.alloc_pages(room, {"target": 6})
        decode.register(room, addrs, 70)
        time.sleep(0.2)  # both prefills hold the registration now
        owner.start_room(room)
        owner.run_prefill(room, [("target", 0, 2), ("target", 2, 4)], 0.0, 0.0, 9, None)
        assert tuple(decode.wait(room, 60)) == ("Success", "")
        assert decode.digest(room, "target", 5) == owner.digest(room, "target", 5)
        decode.free_room(room)
    time.sleep(2.5)  # unclaimed registrations expire silently on the other instance
    for p in (p1, p2):
        assert p.released_counts() == {str(r): 1 for r in ((2,) if p is p1 else (1,))}
    assert [p.free_counts() for p in (p1, p2, decode)] == free0
