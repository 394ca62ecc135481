"""The long-lived threads of a stage never die of one exception: the control loop (a handler
that raises), the metrics publisher (stats that raise, a metric call that raises) and the trace
writer (a directory that is gone). Each counts the error and goes on working."""

from __future__ import annotations

import threading
import time

import zmq

from backends.stages.trace import TraceWriter
from backends.stages.triton_glue import StageMetrics
from kvtransfer.config import TransferConfig
from kvtransfer.control.loop import ControlLoop


class Flaky(ControlLoop):
    """Its handlers raise the first ``n`` times they run."""

    def __init__(self, n: int):
        super().__init__(TransferConfig())
        self.n, self.ticks, self.frames = n, 0, []
        self.pull = self.socket(zmq.PULL)
        self.port = self.pull.bind_to_random_port("tcp://127.0.0.1")

    def on_tick(self, now: float) -> None:
        self.ticks += 1
        if self.ticks <= self.n:
            raise RuntimeError("tick bug")

    def on_frames(self, sock, frames) -> None:
        self.frames.append(frames[0].bytes)
        if len(self.frames) <= self.n:
            raise ValueError("handler bug")


def test_the_control_loop_counts_a_raising_handler_and_goes_on():
    loop = Flaky(2)
    loop.start()
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(f"tcp://127.0.0.1:{loop.port}")
    try:
        for i in range(5):
            push.send(b"%d" % i)
        deadline = time.time() + 10
        while len(loop.frames) < 5:
            assert time.time() < deadline, loop.frames
            time.sleep(0.02)
        assert loop.call_sync(lambda: 42) == 42  # the loop still serves calls
        assert loop.loop_errors >= 2  # counted
        while loop.ticks <= 3:  # ticks go on after the ones that raised
            assert time.time() < deadline, loop.ticks
            time.sleep(0.02)
    finally:
        ctx.destroy(linger=0)
        loop.close()


class FakeMetric:
    def __init__(self, sink: dict, name: str, fail: list):
        self.sink, self.name, self.fail = sink, name, fail

    def set(self, v: float) -> None:
        if self.fail:
            self.fail.pop()
            raise RuntimeError("metric call failed")
        self.sink[self.name] = v

    def increment(self, v: float) -> None:
        self.sink[self.name] = self.sink.get(self.name, 0.0) + v


class FakePb:
    def __init__(self, fail_calls: int):
        sink, fail = {}, [1] * fail_calls
        self.sink = sink

        class MetricFamily:
            COUNTER, GAUGE = "counter", "gauge"

            def __init__(self, name, description, kind):
                self.name = name

            def Metric(self, labels):  # noqa: N802 - Triton's name
                return FakeMetric(sink, self.name, fail)

        self.MetricFamily = MetricFamily


def test_the_metrics_thread_survives_raising_stats_and_metric_calls():
    calls = {"n": 0}

    def stats():
        calls["n"] += 1
        if calls["n"] in (2, 3):
            raise KeyError("stats bug")
        return {"pages_in_use": calls["n"]}

    pb = FakePb(fail_calls=2)
    m = StageMetrics(pb, "prefill", "prefill_0_0", stats, interval=0.01)
    try:
        deadline = time.time() + 10
        while pb.sink.get("pd_kv_pages_in_use", 0) < 6:
            assert time.time() < deadline, pb.sink
            time.sleep(0.02)
        assert m._thread.is_alive()
    finally:
        m.close()


def test_a_trace_write_that_fails_is_counted_not_raised(tmp_path):
    t = TraceWriter(str(tmp_path / "gone"), "prefill0")
    for _ in range(3):
        t.write({"room": 1})
    assert t.errors == 3
    (tmp_path / "gone").mkdir()
    t.write({"room": 2})
    assert t.errors == 3 and (tmp_path / "gone").iterdir()
    assert threading.current_thread().is_alive()


def test_the_rank_watch_survives_a_check_that_raises(monkeypatch):
    """A tensor-parallel stage exits when a rank died (to be loaded again): a rank check that
    raises once must not end the watch, or a later dead rank would leave the stage hung."""
    from backends.stages import triton_glue as g

    exited, answers = threading.Event(), [RuntimeError("rank pipe closed mid-read"), None]
    over = threading.Event()  # after the test: no rank ever dies (the real os._exit is back)

    class Runner:
        def failure(self):
            if answers:
                got = answers.pop(0)
                if isinstance(got, Exception):
                    raise got
                return got
            return None if over.is_set() else "tensor-parallel rank 1 died (exit code -9)"

    monkeypatch.setattr(g.os, "_exit", lambda code: exited.set())
    monkeypatch.setattr(g, "_say", lambda msg: None)
    try:
        g.exit_when_a_rank_dies("prefill_0", Runner(), grace_s=0.0)
        assert exited.wait(10), "the watch died with the check that raised"
        assert answers == []
    finally:
        over.set()
