"""A tensor-parallel worker: ranks 1..N-1 of a runner, each a process that rank 0 spawned.

Life of a worker (rank 0's side is :mod:`backends.runtime.tp.runner`):

1. load its weight shard, then say ``ready`` on its pipe;
2. on ``go``, join the process group (every rank joins at once, so the rendezvous is quick
   however long loading took), build the model, say ``ok`` (or ``error: ...`` and exit 1);
3. run rank 0's commands (:mod:`backends.runtime.tp.wire`) until ``STOP`` or until the pipe
   closes. A failed forward ends the process (exit 1): the ranks are out of step after it and
   rank 0 reports this rank as dead.

A worker dies with rank 0: a thread waits on the parent's sentinel and ends the process when the
parent is gone, even while the main thread is blocked in a collective; the pipe's EOF ends the
command loop too. One torch thread per worker (``threads``): on a shared 2-core host every
extra spinning thread costs a rank's core.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import sys
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

log = logging.getLogger(__name__)

READY, GO, OK = b"ready", b"go", b"ok"
ERROR = b"error: "


@dataclass(frozen=True)
class WorkerSpec:
    path: str
    dtype: str
    device: str
    num_layers: int | None
    rank: int
    size: int
    store_port: int
    timeout_s: float
    threads: int = 1


def _die_with_parent() -> None:
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(0)  # rank 0 is gone: nothing to serve, nobody to report to

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


def worker_main(spec: WorkerSpec, conn: Connection, kv_conn: Connection | None = None) -> None:
    """Entry point of a worker process (multiprocessing spawn target). ``kv_conn``: the pipe
    of this rank's KV agent (:mod:`kvtransfer.tp.agent`), started when rank 0 asks."""
    _die_with_parent()
    import torch

    from .comm import TPGroup, join_store
    from .rank import ShardRunner, load_config, load_shard
    from .shard import ShardPlan

    torch.set_num_threads(spec.threads)
    try:
        config = load_config(spec.path, spec.num_layers)
        plan = ShardPlan.build(config, spec.size, spec.rank)
        tensors = load_shard(spec.path, config, plan, spec.dtype, spec.device)
        conn.send_bytes(READY)
        if conn.recv_bytes() != GO:
            return
        group = TPGroup(
            join_store(spec.store_port, spec.timeout_s),
            spec.rank,
            spec.size,
            spec.device,
            spec.timeout_s,
        )
        runner = ShardRunner.build(spec.path, config, tensors, plan, group, spec.dtype, spec.device)
        del tensors
        conn.send_bytes(OK)
    except EOFError:
        return
    except Exception as e:  # report, then exit: rank 0 raises it at load
        conn.send_bytes(ERROR + f"{type(e).__name__}: {e}".encode())
        sys.exit(1)
    pools: dict = {}
    if kv_conn is not None:
        threading.Thread(
            target=_kv_agent, args=(kv_conn, pools), name="kv-agent", daemon=True
        ).start()
    try:
        serve(runner, conn, pools)
    finally:
        group.shutdown()


def _kv_agent(kv_conn: Connection, pools: dict) -> None:
    """This rank's KV agent over the pools rank 0 names (by pool id)."""
    from kvtransfer import serve_start

    def pools_of(ids: dict[str, int]):
        missing = [i for i in ids.values() if i not in pools]
        if missing:
            raise ValueError(f"no pool {missing[0]} on this rank")
        got = {role: pools[i] for role, i in ids.items()}
        return ({r: p.tensor for r, p in got.items()}, {r: p.layout for r, p in got.items()})

    serve_start(kv_conn, pools_of)


def serve(runner, conn: Connection, pools: dict) -> None:
    """Run rank 0's commands until STOP or EOF; a failed forward ends the process (exit 1)."""
    from ..paged import SeqInput
    from .wire import (
        DROP_POOL,
        FORWARD,
        LAYOUT,
        MAKE_POOL,
        PREFILL,
        STOP,
        decode,
        encode_layout,
        seq_fields,
    )

    while True:
        try:
            cmd = decode(conn.recv_bytes())
        except EOFError:
            return
        if cmd.op == STOP:
            return
        if cmd.op == MAKE_POOL:
            try:
                pool = runner.make_pool(
                    cmd.num_pages, cmd.page_size, cmd.role, cmd.num_slots, cmd.window_pages
                )
                pools[cmd.pool_id] = pool
                if pool.window is not None:  # its sliding-window entry, by an id of its own
                    pools[cmd.window_id] = pool.window
                if pool.states is not None:  # its state slots, likewise
                    pools[cmd.state_id] = pool.states
                    # rank 0 owns the slot allocator and checked each slot it sends: here
                    # every slot is held, so a forward may name any of them
                    for _ in range(pool.states.num_slots):
                        pool.states.alloc()
                conn.send_bytes(OK)
            except Exception as e:  # e.g. out of memory: rank 0 raises it from make_pool
                conn.send_bytes(ERROR + f"{type(e).__name__}: {e}".encode())
            continue
        if cmd.op == DROP_POOL:
            pools.pop(cmd.pool_id, None)
            continue
        if cmd.op == LAYOUT:
            pool = pools.get(cmd.pool_id)
            if pool is None:
                conn.send_bytes(ERROR + f"no pool {cmd.pool_id} on this rank".encode())
            else:
                conn.send_bytes(encode_layout(pool.layout))
            continue
        try:
            pool = pools[cmd.pool_id]
            inputs = []
            for seq in cmd.seqs:
                tokens, start, pages, window, slot = seq_fields(seq)
                inputs.append(SeqInput(tokens, start, pages, slot, window))
            if cmd.op == FORWARD:
                runner.forward(pool, inputs, last_only=cmd.last_only)
            elif cmd.op == PREFILL:
                runner.prefill_batch(pool, inputs)
        except Exception:
            log.exception("tensor-parallel rank %d: forward failed; exiting", runner.plan.rank)
            sys.exit(1)
