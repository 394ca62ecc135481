"""Rank 0's handles on its worker processes: spawn, answers under a deadline, death, stop.

A worker answers rank 0 on its pipe (``ready``, ``ok``, a layout, or ``error: ...``);
:meth:`WorkerHandle.answer` waits on the pipe AND the process sentinel, so a worker that dies
while rank 0 waits is reported at once ("tensor-parallel rank 1 died (exit code -9)"), and one
that hangs after ``timeout_s``. :func:`stop_workers` asks politely (STOP), then terminates, then
kills: no worker survives it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from multiprocessing.connection import Connection, wait

from .comm import RankAnswerError, TensorParallelError
from .wire import STOP, Command, encode
from .worker import ERROR, WorkerSpec, worker_main


class WorkerHandle:
    def __init__(self, rank: int, proc, conn: Connection, kv_conn: Connection):
        self.rank, self.proc, self.conn, self.kv_conn = rank, proc, conn, kv_conn

    def death(self, grace_s: float = 1.0) -> str | None:
        """Why the worker is gone, or None while it runs (waits up to ``grace_s`` for a dying
        process to be reaped)."""
        if self.proc.exitcode is None and grace_s > 0:
            # join, not a wait on the sentinel alone: a dying process closes its pipes (and
            # sockets: the peer's collective fails) a moment before the kernel can reap it
            self.proc.join(grace_s)
        code = self.proc.exitcode
        return None if code is None else f"tensor-parallel rank {self.rank} died (exit code {code})"

    def answer(self, timeout_s: float, what: str) -> bytes:
        """The worker's next answer; RankAnswerError on an error answer, TensorParallelError on
        death or timeout."""
        ready = wait([self.conn, self.proc.sentinel], timeout_s)
        if self.conn in ready:
            try:
                msg = self.conn.recv_bytes()
            except (EOFError, OSError):
                msg = b""
            if msg.startswith(ERROR):
                reason = msg[len(ERROR) :].decode(errors="replace")
                raise RankAnswerError(f"tensor-parallel rank {self.rank}: {what}: {reason}")
            if msg:
                return msg
        if ready:
            raise TensorParallelError(f"{self.death()}: {what}")
        raise TensorParallelError(
            f"tensor-parallel rank {self.rank}: no answer within {timeout_s:.0f} s ({what})"
        )

    def expect(self, want: bytes, timeout_s: float, what: str) -> None:
        msg = self.answer(timeout_s, what)
        if msg != want:
            raise TensorParallelError(
                f"tensor-parallel rank {self.rank}: {what}: answered {msg[:32]!r}, want {want!r}"
            )


def stop_workers(workers: list[WorkerHandle], grace_s: float) -> None:
    stop = encode(Command(STOP))
    for w in workers:
        try:
            w.conn.send_bytes(stop)
        except OSError:
            pass
    for w in workers:
        w.proc.join(grace_s)
        if w.proc.is_alive():
            w.proc.terminate()
            w.proc.join(2.0)
        if w.proc.is_alive():
            w.proc.kill()
            w.proc.join()
        w.conn.close()
        w.kv_conn.close()


def python_exe() -> str:
    """The interpreter a worker runs: this process's own installation. An embedded interpreter
    (Triton's Python stub) reports the PATH's ``python3`` as ``sys.executable``, which may be
    another installation whose stdlib does not match the ``sys.path`` the worker inherits
    (measured: the stub on Debian's libpython 3.11, ``sys.executable`` a pyenv shim; numpy then
    failed to import in the worker)."""
    base = os.path.realpath(sys.base_exec_prefix)
    if sys.executable and os.path.realpath(sys.executable).startswith(base + os.sep):
        return sys.executable
    own = os.path.join(base, "bin", f"python{sys.version_info[0]}.{sys.version_info[1]}")
    return own if os.access(own, os.X_OK) else sys.executable


def spawn_worker(spec: WorkerSpec) -> WorkerHandle:
    """Start rank ``spec.rank`` in a spawned process (never forked: the serving process runs
    zmq / Mooncake threads) with a pipe to it; daemonic, so it cannot outlive a clean exit."""
    ctx = mp.get_context("spawn")
    ctx.set_executable(python_exe())
    conn, child = ctx.Pipe()
    kv_conn, kv_child = ctx.Pipe()  # the rank's KV agent (kvtransfer.tp.agent), on demand
    proc = ctx.Process(
        target=worker_main,
        args=(spec, child, kv_child),
        name=f"pd-tp-rank{spec.rank}",
        daemon=True,
    )
    proc.start()
    child.close()
    kv_child.close()
    return WorkerHandle(spec.rank, proc, conn, kv_conn)
