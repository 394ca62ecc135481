"""Staged transfers (fragmented page tables gathered into slots, one write per slot, scattered
by decode) between two OS processes over the real Mooncake engine: byte-exact for every layout
and page size, chunks that cut across layers and components, the draft entry, and no byte
outside the room's claimed pages."""

import math

import pytest
from kvpeer import LAYOUTS
from test_transfer_bytes import assert_same_bytes, run_room

from kvtransfer import EntryLayout

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def page_bytes(name: str, page_size: int) -> int:
    kw = dict(LAYOUTS[name], role="target", page_size=page_size, num_pages=1)
    return EntryLayout(**kw).page_bytes


def staging_config(page_bytes_max: int) -> dict:
    # a slot holds 5 pages and a bit: chunks end inside layers and components, and a group
    # takes many chunks through 2 lent slots (so slots are granted back and reused)
    return dict(staging_slot_bytes=5 * page_bytes_max + 7, staging_grants_per_room=2)


@pytest.mark.parametrize("name", ["gqa", "mla"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_fragmented_tables_are_staged_byte_exact(spawn, name, page_size):
    pool = 1500 // page_size + 24
    entries = {"target": (name, page_size, pool)}
    cfg = staging_config(page_bytes(name, page_size))
    prefill = spawn("prefill", entries, seed=page_size, **cfg)
    decode = spawn("decode", entries, seed=page_size, **cfg)
    free0 = (prefill.free_counts(), decode.free_counts())
    groups = [("target", 0, 1), ("target", 1, 3), ("target", 3, 4)]
    cases = {41: 700, 42: 1, 43: 3 * page_size + 1}
    for room, tokens in cases.items():
        before = prefill.stats()["staged"]["chunks"]
        st, need = run_room(prefill, decode, room, {"target": tokens}, groups)
        assert st == ("Success", "")
        assert decode.saw_all_bytes_at_complete(room) is True
        assert_same_bytes(prefill, decode, room, need)
        pages = math.ceil(tokens / page_size)
        if pages > 1:  # fragmented: went through the slots, at least one chunk per group
            assert prefill.stats()["staged"]["chunks"] - before >= len(groups)
    # only the prompt pages of those rooms were written (the rest of the pool is still zero)
    assert decode.untouched_except_prompts(list(cases), cases)
    for room in cases:
        decode.free_room(room)
    assert (prefill.free_counts(), decode.free_counts()) == free0


def test_contiguous_tables_go_direct(spawn):
    entries = {"target": ("gqa", 16, 200)}
    prefill = spawn("prefill", entries, seed=5)
    decode = spawn("decode", entries, seed=5)
    groups = [("target", 0, 2), ("target", 2, 4)]
    st, need = run_room(prefill, decode, 51, {"target": 1000}, groups, fragmented=False)
    assert st == ("Success", "")
    assert_same_bytes(prefill, decode, 51, need)
    assert prefill.stats()["staged"]["chunks"] == 0


def test_mla_target_and_gqa_draft_staged(spawn):
    entries = {"target": ("mla", 16, 200), "draft": ("draft_gqa", 16, 200)}
    cfg = staging_config(page_bytes("mla", 16))
    prefill = spawn("prefill", entries, seed=3, **cfg)
    decode = spawn("decode", entries, seed=3, **cfg)
    free0 = (prefill.free_counts(), decode.free_counts())
    groups = [("target", 0, 1), ("target", 1, 4), ("draft", 0, 2)]
    st, need = run_room(prefill, decode, 61, {"target": 777, "draft": 777}, groups)
    assert st == ("Success", "")
    assert decode.saw_all_bytes_at_complete(61) is True
    assert_same_bytes(prefill, decode, 61, need)
    assert prefill.stats()["staged"]["groups"] == 3
    assert decode.result(61)[0] == 1061
    decode.free_room(61)
    assert (prefill.free_counts(), decode.free_counts()) == free0


def test_staged_room_failure_frees_pages_and_slots(spawn):
    """Injected write failures on a staged room: the room fails on both sides, every page is
    released once, and the decode's slots come back (the next room still stages)."""
    entries = {"target": ("gqa", 16, 200)}
    cfg = staging_config(page_bytes("gqa", 16))
    prefill = spawn("prefill", entries, seed=9, **cfg)
    decode = spawn("decode", entries, seed=9, **cfg)
    free0 = (prefill.free_counts(), decode.free_counts())
    groups = [("target", 0, 2), ("target", 2, 4)]
    prefill.call("set_faults", "fail=1.0")
    st, _ = run_room(prefill, decode, 71, {"target": 600}, groups, expect="Failed")
    assert st[0] == "Failed" and "transfer failed" in st[1]
    prefill.call("set_faults", "")
    for room in range(72, 72 + 6):  # more rooms than the decode has slots for at once
        st, need = run_room(prefill, decode, room, {"target": 600}, groups)
        assert st == ("Success", "")
        assert_same_bytes(prefill, decode, room, need)
        decode.free_room(room)
    assert (prefill.free_counts(), decode.free_counts()) == free0
    assert decode.released_counts()["71"] == 1 and prefill.released_counts()["71"] == 1
