"""Tensor-parallel worker lifecycle: a dead or hung rank gives a clear error in bounded time, and
no worker process outlives close() or its rank 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import runtime_models as rm

from backends.runtime.paged import SeqInput
from backends.runtime.tp.comm import TensorParallelError
from backends.runtime.tp.runner import TPModelRunner

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def running(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not running(pid):
            return True
        time.sleep(0.05)
    return False


def start(timeout_s: float = 60.0) -> TPModelRunner:
    return TPModelRunner.start(rm.checkpoint("llama"), size=2, timeout_s=timeout_s)


def test_close_stops_every_worker_and_the_runner_refuses_later_calls():
    runner = start()
    pool = runner.make_pool(4, 4)
    runner.forward(pool, [SeqInput([5, 6], 0, [0])])
    (pid,) = runner.worker_pids
    runner.close()
    assert not running(pid)
    assert runner.workers[0].proc.exitcode == 0  # it took STOP and exited on its own
    runner.close()  # idempotent
    with pytest.raises(TensorParallelError, match="closed"):
        runner.forward(pool, [SeqInput([5], 0, [0])])


def test_killed_worker_makes_the_next_forward_raise_naming_it():
    runner = start()
    pool = runner.make_pool(4, 4)
    (pid,) = runner.worker_pids
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"tensor-parallel rank 1 died \(exit code -9\)"):
        runner.forward(pool, [SeqInput([5, 6], 0, [0])])
    assert time.monotonic() - t0 < 10
    with pytest.raises(TensorParallelError, match="rank 1 died"):  # broken for good, at once
        runner.decode(pool, [5], [0], [[0]])
    runner.close()
    assert not running(pid)


def test_hung_worker_makes_the_forward_raise_after_the_collective_deadline():
    runner = start(timeout_s=3.0)
    pool = runner.make_pool(4, 4)
    (pid,) = runner.worker_pids
    os.kill(pid, signal.SIGSTOP)  # alive but never answers
    try:
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match="did not answer within 3 s"):
            runner.forward(pool, [SeqInput([5, 6], 0, [0])])
        assert time.monotonic() - t0 < 3.0 + 10
    finally:
        runner.close()
    assert not running(pid)


RANK0 = """
import sys, time
from backends.runtime.tp.runner import TPModelRunner
r = TPModelRunner.start(sys.argv[1], size=2)
print(r.worker_pids[0], flush=True)
time.sleep(120)
"""


def test_workers_die_with_rank_0():
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-c", RANK0, rm.checkpoint("llama")],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        pid = int(proc.stdout.readline())
        assert running(pid)
        proc.kill()
        proc.wait(10)
        assert wait_gone(pid, 10), "worker outlived its rank 0"
    finally:
        proc.kill()
        proc.wait(10)


def test_worker_killed_during_a_collective_fails_the_forward_at_once():
    runner = start(timeout_s=60.0)
    pool = runner.make_pool(4, 4)
    (pid,) = runner.worker_pids
    os.kill(pid, signal.SIGSTOP)  # rank 0 will wait for it in the first all_reduce ...
    killer = threading.Timer(1.0, os.kill, (pid, signal.SIGKILL))  # ... until it dies there
    killer.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"rank 1 died \(exit code -9\)"):
            runner.forward(pool, [SeqInput([5, 6], 0, [0])])
        assert time.monotonic() - t0 < 10  # the closed socket, not the 60 s deadline
    finally:
        killer.join()
        runner.close()
    assert not running(pid)


def test_an_error_answer_is_typed_apart_from_a_silent_rank():
    """Rank 0 passes a live rank's error answer on and breaks the runner only for a death or a
    timeout: told apart by type (RankAnswerError), whatever the error's words ("no answer")."""
    from multiprocessing import Pipe
    from types import SimpleNamespace

    from backends.runtime.tp.comm import RankAnswerError
    from backends.runtime.tp.procs import WorkerHandle
    from backends.runtime.tp.worker import ERROR

    ours, theirs = Pipe()
    never, _keep = Pipe()  # a sentinel that never fires: the process runs
    h = WorkerHandle(1, SimpleNamespace(exitcode=None, sentinel=never), ours, None)
    theirs.send_bytes(ERROR + b"no answer from the KV peer")
    with pytest.raises(RankAnswerError, match="no answer from the KV peer"):
        h.answer(5.0, "scatter")
    with pytest.raises(TensorParallelError, match="no answer within 0 s") as silent:
        h.answer(0.05, "scatter")
    assert not isinstance(silent.value, RankAnswerError)
