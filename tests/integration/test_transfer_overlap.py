"""Layer-grouped streaming overlaps prefill compute; completion waits for every group + draft."""

import time

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

LAYER_SLEEP = 0.3  # compute stub per layer: long against a few-KB group write on loopback


def test_group_lands_before_next_group_computed(spawn):
    entries = {"target": ("gqa", 16, 64), "draft": ("draft_gqa", 16, 64)}
    prefill = spawn("prefill", entries)
    decode = spawn("decode", entries)
    free0 = (prefill.free_counts(), decode.free_counts())
    room = 5
    prefill.alloc_pages(room, {"target": 8, "draft": 8})
    decode.alloc_pages(room, {"target": 10, "draft": 10})
    groups = [
        ("target", 0, 1),
        ("target", 1, 2),
        ("target", 2, 3),
        ("target", 3, 4),
        ("draft", 0, 2),
    ]
    decode.register(
        room,
        [prefill.info["bootstrap_addr"]],
        120,
        watch=groups,
        watch_pages={"target": 8, "draft": 8},
    )
    prefill.start_room(room)
    prefill.run_prefill(room, groups, LAYER_SLEEP, LAYER_SLEEP, 77, {"k": 1})
    assert tuple(decode.wait(room, 60)) == ("Success", "")
    assert tuple(prefill.wait(room, 30)) == ("Success", "")

    computed = prefill.prefill_log(room)["computed"]
    # completion only after the last target group AND the draft KV landed
    assert decode.saw_all_bytes_at_complete(room) is True
    end = time.time() + 10  # the watcher thread polls; give it time to note the last group
    while len(decode.landed_times(room)) < len(groups) and time.time() < end:
        time.sleep(0.05)
    landed = decode.landed_times(room)
    assert [g[:3] for g in landed] == [tuple(g) for g in groups]
    for k in range(len(groups) - 1):
        # group k's bytes were in decode's pages before prefill finished computing group k+1
        assert landed[k][3] < computed[k + 1][3], (k, landed, computed)
    assert decode.release_at(room) >= prefill.prefill_log(room)["finish_called"]
    # sender stats: one record per group, each landed before the next was computed
    stats = prefill.room_stats(room)
    assert [g["ok"] for g in stats["groups"]] == [True] * len(groups)
    for k in range(len(groups) - 1):
        assert stats["groups"][k]["done"] < computed[k + 1][3]
    assert stats["nbytes"] > 0
    decode.free_room(room)
    assert (prefill.free_counts(), decode.free_counts()) == free0
