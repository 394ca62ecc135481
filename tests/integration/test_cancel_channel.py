"""The client-cancel channel (backends/stages/cancel.py) over real zmq sockets: a fresh signed
Cancel reaches decode once; stale, replayed, unsigned and wrong-type frames are dropped and
counted, and a flood of them is logged only a few times."""

from __future__ import annotations

import logging
import queue
import time

import pytest
import zmq

from backends.stages.cancel import CancelListener, CancelSender
from kvtransfer import messages as m

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
SECRET = b"cancel-channel-secret-0123456789"


@pytest.fixture
def channel():
    got: queue.SimpleQueue = queue.SimpleQueue()
    lis = CancelListener("127.0.0.1", got.put, SECRET, max_age_s=30.0)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(f"tcp://{lis.addr}")
    try:
        yield lis, push, got
    finally:
        ctx.destroy(linger=0)
        lis.close()


def _settle(lis: CancelListener, dropped: int, got: queue.SimpleQueue, cancels: int) -> list:
    """Wait (bounded) until the listener dropped ``dropped`` frames and saw ``cancels``; return
    the rooms cancelled (the waits end early only when both counts are reached)."""
    deadline, rooms = time.time() + 10, []
    while time.time() < deadline and (lis.dropped < dropped or len(rooms) < cancels):
        try:
            rooms.append(got.get(timeout=0.05))
        except queue.Empty:
            pass
    time.sleep(0.3)  # nothing more may arrive
    while not got.empty():
        rooms.append(got.get())
    return rooms


def test_fresh_cancel_reaches_decode_once_and_its_replay_is_dropped(channel):
    lis, push, got = channel
    frame = m.encode(m.Cancel(41), SECRET)
    push.send(frame)
    push.send(frame)  # captured and sent again
    assert _settle(lis, 1, got, 1) == [41]
    assert lis.dropped_by_kind == {"replay": 1}


def test_stale_unsigned_and_wrong_type_frames_cancel_nothing(channel):
    lis, push, got = channel
    push.send(m.encode(m.Cancel(7), SECRET, now=time.time() - 600))  # captured long ago
    push.send(m.encode(m.Cancel(8), SECRET, now=time.time() + 600))  # from the future
    push.send(m.encode(m.Cancel(9)))  # unsigned
    push.send(m.encode(m.Cancel(10), b"k" * 32))  # another key
    push.send(m.encode(m.Ping(1), SECRET))  # signed, but not a Cancel
    push.send(b"\x93garbage")
    sender = CancelSender(SECRET)  # the one real cancel, through postprocess's sender
    try:
        sender.cancel(lis.addr, 11)
        assert _settle(lis, 6, got, 1) == [11]
    finally:
        sender.close()
    assert lis.dropped_by_kind == {"stale": 2, "auth": 2, "unexpected": 1, "garbage": 1}


def test_a_flood_of_bad_frames_is_logged_a_few_times(channel, caplog):
    lis, push, got = channel
    with caplog.at_level(logging.WARNING, logger="backends.stages.cancel"):
        for i in range(300):
            push.send(m.encode(m.Cancel(i)))  # unsigned
        assert _settle(lis, 300, got, 0) == []
    assert lis.dropped == 300
    # the first five, then at 8, 16, 32, 64, 128, 256
    assert len([r for r in caplog.records if "dropped a frame" in r.message]) == 11
