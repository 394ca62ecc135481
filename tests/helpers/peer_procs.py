"""How the test peers start their OS processes (kvpeer, stagepeer): forked from one forkserver
that imported torch, kvtransfer (Mooncake) and the stage cores once.

Each peer is still its own process with its own Mooncake engine, made after the fork (the
forkserver runs no thread and holds no engine or socket). Spawned, each peer imported all of
that itself: a prefill and decode pair of kvpeer started in 2.9-4.0 s, from the forkserver in
0.12-0.14 s (the first pair 1.5 s, while the forkserver imports; 2 cores, OMP_NUM_THREADS=1).

The forkserver keeps the environment it started with, so a peer takes the test process's
environment of the moment with it (``with_env``): a test's ``monkeypatch.setenv`` before it
starts a peer reaches the peer, as it did when each was spawned.
"""

from __future__ import annotations

import multiprocessing as mp
import os

# imported once by the forkserver; one that does not import there is skipped (kvpeer and
# stagepeer where tests/helpers is not on the path: a benchmark that uses them)
PRELOAD = ["torch", "numpy", "kvtransfer", "backends.runtime.loader", "backends.stages.prefill",
           "backends.stages.decode", "kvpeer", "stagepeer"]  # fmt: skip


def context():
    """The multiprocessing context peers start in."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def process(target, args: tuple):
    """A daemon process of :func:`context` that runs ``target(*args)`` in this process's
    current environment."""
    return context().Process(target=with_env, args=(dict(os.environ), target, *args), daemon=True)


def with_env(env: dict, target, *args) -> None:
    os.environ.clear()
    os.environ.update(env)
    target(*args)
