import pytest

from kvtransfer.config import TransferConfig
from kvtransfer.control import state
from kvtransfer.control.state import Room, RoomStatus, RoomTable
from kvtransfer.control.stats import TransferStats, reason_key

S = RoomStatus


def test_forward_only_and_failed_sticky(monkeypatch):
    monkeypatch.setattr(state, "DEBUG", False)
    r = Room(room=1)
    assert r.advance(S.WaitingForInput) and r.advance(S.Transferring)
    assert not r.advance(S.WaitingForInput) and r.status == S.Transferring  # backwards ignored
    assert r.advance(S.Failed, "boom") and r.reason == "boom"
    assert not r.advance(S.Success) and not r.advance(S.Failed, "again")
    assert r.status == S.Failed and r.reason == "boom"


def test_skipping_ahead_is_allowed_and_success_is_final(monkeypatch):
    monkeypatch.setattr(state, "DEBUG", False)
    r = Room(room=1)
    assert r.advance(S.Success)
    assert not r.advance(S.Failed, "late")
    assert r.status == S.Success


def test_backwards_raises_in_debug(monkeypatch):
    monkeypatch.setattr(state, "DEBUG", True)
    r = Room(room=1, status=S.Transferring)
    with pytest.raises(state.TransitionError):
        r.advance(S.Bootstrapping)
    assert r.advance(S.Transferring) is False  # same state: a no-op, not an error


def test_order():
    assert S.Bootstrapping < S.WaitingForInput < S.Transferring < S.Success
    assert [s.ended for s in S] == [True, False, False, False, True]


def test_table_tombstones_block_recreation_and_are_bounded():
    t = RoomTable(max_tombstones=3)
    r = t.add(Room(room=1))
    with pytest.raises(KeyError):
        t.add(Room(room=1))
    r.advance(S.Failed, "x")
    t.bury(1)
    assert t.get(1) is None and t.ended(1) and t.status(1) == (S.Failed, "x")
    with pytest.raises(KeyError, match="already ended"):
        t.add(Room(room=1))
    for room in range(2, 6):
        t.add(Room(room=room)).advance(S.Success)
        t.bury(room)
    assert len(t.tombstones) == 3 and not t.ended(1) and t.ended(5)
    assert t.status(99) is None


def test_stats_counts_failures_by_reason():
    st = TransferStats()
    g = st.group_submitted(1, "target", range(0, 2), 1000, 4)
    st.group_done(g, True)
    st.room_ended(1, True)
    st.room_ended(2, False, "bootstrap timeout: no prefill claimed")
    st.room_ended(3, False, "bootstrap timeout: other")
    snap = st.snapshot()
    assert snap["bytes"] == 1000 and snap["rooms_ok"] == 1 and snap["rooms_failed"] == 2
    assert snap["failures"] == {"bootstrap timeout": 2}
    assert st.get_room(1)["nbytes"] == 1000
    assert reason_key("") == "unknown"


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(protocol="udp"), "protocol"),
        (dict(rdma_device="mlx5_0"), "rdma"),
        (dict(bootstrap_timeout_s=0), "bootstrap_timeout_s"),
        (dict(shared_secret=b"short"), "16 bytes"),
        (dict(max_batch_entries=4096), "max_batch_entries"),
        (dict(max_inflight_entries=4096), "max_inflight_entries"),
        (dict(bootstrap_port=70000), "bootstrap_port"),
        (dict(host="not a host"), "host"),
        (dict(num_workers=3), "num_workers"),
    ],
)
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        TransferConfig(**kw)


def test_config_secret_str_becomes_bytes():
    assert TransferConfig(shared_secret="x" * 16).shared_secret == b"x" * 16
