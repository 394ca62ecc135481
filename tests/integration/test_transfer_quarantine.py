"""When decode gives a room up, its pages are reused only once no prefill can still write into
them: after that prefill said so (its Fail), or after the connection that carried the Register
closed. Also: a bad bootstrap address or a room id in use fails that room or call only."""

import os
import signal
import time

import pytest
from test_transfer_failures import ENTRIES, mid_transfer, serve_ok, start

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def wait_released(decode, room: int, timeout: float) -> None:
    end = time.time() + timeout
    while decode.released_counts().get(str(room)) is None:
        assert time.time() < end, f"room {room}'s pages never released"
        time.sleep(0.05)


def wait_ended(decode, room: int, timeout: float) -> tuple[str, str]:
    end = time.time() + timeout
    while (outcome := decode.ended(room)) is None:
        assert time.time() < end, f"room {room} never ended"
        time.sleep(0.05)
    return tuple(outcome)


def test_a_frozen_prefill_keeps_the_pages_quarantined_until_its_connection_closes(spawn):
    prefill, decode, free0 = mid_transfer(spawn)
    os.kill(prefill.proc.pid, signal.SIGSTOP)  # alive, connected, silent: writes may be queued
    try:
        status, reason = wait_ended(decode, 1, 30)  # held in quarantine: not released
        assert status == "Failed" and reason.startswith("prefill peer lost"), reason
        time.sleep(2.0)
        assert decode.released_counts().get("1") is None  # still quarantined
        assert decode.call("quarantined") == {1}
    finally:
        prefill.kill()  # its connection closes: nothing of it can write any more
    wait_released(decode, 1, 15)
    serve_ok(spawn("prefill", ENTRIES, seed=9), decode, 2)
    assert decode.free_counts() == free0
    assert decode.released_counts() == {"1": 1, "2": 1}


def test_a_room_given_up_before_prefill_answered_waits_for_its_fail(spawn):
    """The Register sits in a frozen prefill's socket (the two are connected already). Decode
    gives up (bootstrap timeout) but keeps the pages until prefill, resumed, reads Register then
    Abort and answers Fail; prefill never writes into them (they stay zero)."""
    prefill = spawn("prefill", ENTRIES)
    decode = spawn("decode", ENTRIES, bootstrap_timeout_s=1.0)
    serve_ok(prefill, decode, 5)  # connected
    prefill.alloc_pages(1, {"target": 6, "draft": 6})
    prefill.start_room(1)
    os.kill(prefill.proc.pid, signal.SIGSTOP)
    try:
        decode.alloc_pages(1, {"target": 8, "draft": 8})
        decode.register(1, [prefill.info["bootstrap_addr"]], 90)
        status, reason = wait_ended(decode, 1, 30)  # held in quarantine: not released
        assert status == "Failed" and reason.startswith("bootstrap timeout"), reason
        time.sleep(1.0)
        assert decode.released_counts().get("1") is None
    finally:
        os.kill(prefill.proc.pid, signal.SIGCONT)
    wait_released(decode, 1, 15)
    assert tuple(prefill.wait(1, 30))[0] == "Failed"
    assert decode.untouched([5])  # not one byte landed outside room 5's pages
    serve_ok(prefill, decode, 2)


@pytest.mark.parametrize(
    "addr, words",
    [("*:1", "bootstrap address"), ("127.0.0.1:1", "bootstrap timeout"), ("", "address")],
)
def test_a_bad_bootstrap_address_fails_that_room_only(spawn, addr, words):
    prefill = spawn("prefill", ENTRIES)
    decode = spawn("decode", ENTRIES, bootstrap_timeout_s=1.0)
    free0 = decode.free_counts()
    decode.alloc_pages(1, {"target": 8, "draft": 8})
    try:
        decode.register(1, [addr], 90)
    except Exception as e:  # refused at the call: no room was created
        assert words in str(e), e
        decode.free_room(1)
    else:
        status, reason = decode.wait(1, 30)
        assert status == "Failed" and words in reason, reason
        wait_released(decode, 1, 10)  # never reached a prefill: nothing to wait for
    serve_ok(prefill, decode, 2)  # timeouts and rooms go on
    assert decode.free_counts() == free0


def test_a_room_id_in_use_is_refused_and_its_owner_is_unharmed(spawn):
    prefill = spawn("prefill", ENTRIES)
    decode = spawn("decode", ENTRIES)
    start(prefill, decode, 1, layer_sleep=0.3)
    with pytest.raises(Exception, match="KeyError|in use"):
        decode.register(1, [prefill.info["bootstrap_addr"]], 90)
    with pytest.raises(Exception, match="room 1 is not waiting to start"):
        prefill.start_room(1)
    assert tuple(decode.wait(1, 60)) == ("Success", "")
    for role in ("target", "draft"):
        assert decode.digest(1, role, 6) == prefill.digest(1, role, 6)
