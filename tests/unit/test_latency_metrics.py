"""Latency histograms' plumbing (no Triton): observations recorded by the stage cores, drained
by the glue; a room's KV transfer time and bytes reach them once, only when it succeeded."""

from backends.stages.latency import Observations
from backends.stages.metrics import HISTOGRAMS
from kvtransfer.control.stats import TransferStats


def test_request_timestamps_become_observations_and_drain_once():
    obs = Observations()
    obs.request_done({"submitted": 10.0, "registered": 10.5, "first_token": 11.0, "finished": 13.0})
    obs.observe("itl", 0.02)
    got = obs.drain()
    assert got == {"queue": [0.5], "ttft": [1.0], "e2e": [3.0], "itl": [0.02]}
    assert obs.drain() == {}
    assert {h.key for h in HISTOGRAMS} >= set(got) | {"kv_transfer", "kv_bytes"}
    assert all(h.buckets == sorted(h.buckets) for h in HISTOGRAMS)


def test_transfer_stats_observe_each_successful_room():
    obs, st = Observations(), TransferStats()
    st.observer = obs.room_done
    for room, ok in ((1, True), (2, False)):
        g = st.group_submitted(room, "target", range(0, 2), 4096, 2)
        st.group_done(g, ok)
        st.room_ended(room, ok, "" if ok else "transfer failed: x")
    got = obs.drain()
    assert got["kv_bytes"] == [4096.0] and len(got["kv_transfer"]) == 1
