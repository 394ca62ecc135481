"""Rank 0 of a tensor-parallel runner: the ModelRunner the engine drives, owning ranks 1..N-1.

``TPModelRunner`` has ModelRunner's interface (``make_pool``, ``forward``, ``prefill``,
``decode``), so :class:`~backends.runtime.engine.LLMEngine` drives it unchanged. Rank 0 keeps the
one page allocator (its pools' free lists; the workers' pools are never allocated from), checks
each forward's inputs, sends them to every worker (:mod:`backends.runtime.tp.wire`) and runs its
own shard of the same forward; the forward's collectives keep the ranks in step.

Failure rules:

* inputs are validated on rank 0 BEFORE anything is sent, so a bad request never desyncs ranks;
* a worker that died (killed, crashed, its forward failed) makes the next call raise
  ``TensorParallelError("tensor-parallel rank 1 died (exit code -9)")``: rank 0 checks its
  workers before each command, and a collective with a dead peer fails at once (closed socket)
  or after ``timeout_s`` (gloo's deadline on every collective); either way rank 0 names the rank;
* any failure after a command went out leaves the ranks out of step: the runner is then broken
  for good (every later call raises the same error) and its remaining workers are stopped;
* :meth:`close` (also at garbage collection and interpreter exit) stops every worker: STOP, a
  grace period, then terminate and kill. Workers also exit on their own when rank 0 dies.
* ``on_group`` of :meth:`prefill` must not stop rank 0 half-way: an exception it raises is held
  until every layer ran (the other ranks are in the same forward), then re-raised.
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from dataclasses import replace

import torch

from kvtransfer import EntryLayout

from ..cpu_kernels import cpu_ops
from ..kv_pool import KVPool
from ..paged import SeqInput
from ..state_pool import SlotEntry, StatePool
from .comm import RankAnswerError, TensorParallelError, TPGroup, make_store
from .procs import WorkerHandle, spawn_worker, stop_workers
from .rank import ShardRunner, load_config, load_shard
from .shard import ShardPlan, TensorParallelConfigError
from .wire import (
    DROP_POOL,
    FORWARD,
    LAYOUT,
    MAKE_POOL,
    PREFILL,
    Command,
    decode_layout,
    encode,
    wire_seq,
)
from .worker import ERROR, GO, OK, READY, WorkerSpec


def tp_devices(device: str | list[str], size: int) -> list[str]:
    """One device per rank: a list as given; ``cpu`` for every rank; ``cuda:k`` -> k, k+1, ..."""
    if not isinstance(size, int) or size < 1:
        raise TensorParallelConfigError(
            f"tensor_parallel_size must be a positive integer, got {size!r}"
        )
    if not isinstance(device, str):
        devices = [str(torch.device(d)) for d in device]
        if size not in (1, len(devices)):
            raise ValueError(f"tensor_parallel_size {size} but {len(devices)} devices {devices}")
        return devices
    dev = torch.device(device)
    if dev.type == "cpu":
        return ["cpu"] * size
    first = dev.index or 0
    have = torch.cuda.device_count()
    if first + size > have:
        raise ValueError(
            f"tensor_parallel_size {size} from {device} needs GPUs {first}..{first + size - 1}, "
            f"this host has {have}"
        )
    return [f"cuda:{first + r}" for r in range(size)]


def _raise_error_answer(answers: list[bytes]) -> None:
    for a in answers:
        if a.startswith(ERROR):
            raise TensorParallelError(a[len(ERROR) :].decode(errors="replace"))


class TPModelRunner(ShardRunner):
    local_pools = False  # each rank holds its shard of every pool

    @classmethod
    def start(
        cls,
        path: str,
        *,
        dtype: str = "float32",
        device: str | list[str] = "cpu",
        num_layers: int | None = None,
        size: int = 1,
        timeout_s: float = 60.0,
        load_timeout_s: float = 600.0,
        threads_per_rank: int | None = None,
    ) -> TPModelRunner:
        """Start ranks 1..N-1 (spawned, never forked), load rank 0's shard, join the group.

        ``timeout_s``: the deadline of every collective and answer; ``load_timeout_s``: of a
        worker's load. A model that cannot be split ``size`` ways is refused before any spawn.
        ``threads_per_rank``: torch threads of each worker (default: the host's cores shared
        out, at least 1); rank 0's are the caller's to set (``torch.set_num_threads``).
        """
        devices = tp_devices(device, size)
        size = len(devices)
        threads = threads_per_rank or max(1, (os.cpu_count() or 1) // size)
        config = load_config(path, num_layers)
        plan = ShardPlan.build(config, size, 0)
        for r in range(1, size):
            ShardPlan.build(config, size, r)
        if devices[0] == "cpu":
            cpu_ops()  # build the C++ kernels once, before the workers load them
        store = make_store(timeout_s)
        workers: list[WorkerHandle] = []
        try:
            for r in range(1, size):
                spec = WorkerSpec(
                    path, dtype, devices[r], num_layers, r, size, store.port, timeout_s, threads
                )
                workers.append(spawn_worker(spec))
            tensors = load_shard(path, config, plan, dtype, devices[0])
            for w in workers:
                w.expect(READY, load_timeout_s, "loading its shard")
            for w in workers:
                w.conn.send_bytes(GO)
            group = TPGroup(store, 0, size, devices[0], timeout_s)
            runner = cls.build(path, config, tensors, plan, group, dtype, devices[0])
            for w in workers:
                w.expect(OK, load_timeout_s, "building its model")
        except BaseException:
            stop_workers(workers, 0.5)
            raise
        runner._attach(workers, store, group, timeout_s, load_timeout_s)
        return runner

    def _attach(self, workers, store, group, timeout_s: float, load_timeout_s: float) -> None:
        self.workers, self.store, self.group = workers, store, group
        self.timeout_s, self.load_timeout_s = timeout_s, load_timeout_s
        self._lock = threading.RLock()
        self._broken: str | None = None
        self._closed = False
        # a pool's entries (KVPool, its window KVPool, its StatePool) -> the id workers know
        self._pool_ids: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()
        self._dead_pools: list[int] = []  # appended by pool finalizers, sent before a command
        self._next_id = itertools.count(1)
        self._finalizer = weakref.finalize(self, stop_workers, workers, 5.0)

    @property
    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers]

    def failure(self) -> str | None:
        """Why this runner can no longer serve (a rank died, a forward failed), or None while
        it can (or after :meth:`close`); never blocks."""
        if self._closed:
            return None
        dead = [d for d in (w.death(grace_s=0) for w in self.workers) if d]
        return self._broken or (dead[0] if dead else None)

    def close(self) -> None:
        """Stop every worker (idempotent); the runner raises on any later call."""
        self._closed = True
        self._broken = self._broken or "the tensor-parallel runner is closed"
        self._finalizer()
        self.group.shutdown()

    # ---- commands ----------------------------------------------------------------------------
    def _fail(self, reason: str) -> TensorParallelError:
        """Mark the runner broken (naming a dead rank where there is one), stop the workers."""
        dead = [d for d in (w.death(grace_s=1.0) for w in self.workers) if d]
        self._broken = self._broken or (dead[0] if dead else reason)
        self._finalizer.detach()
        stop_workers(self.workers, 0.5)
        return TensorParallelError(self._broken)

    def _check_alive(self) -> None:
        if self._broken:
            raise TensorParallelError(self._broken)
        for w in self.workers:
            dead = w.death(grace_s=0)
            if dead:
                raise self._fail(dead)

    def _send(self, cmd: Command) -> None:
        msgs = [encode(Command(DROP_POOL, self._dead_pools.pop())) for _ in list(self._dead_pools)]
        msgs.append(encode(cmd))
        for w in self.workers:
            try:
                for m in msgs:
                    w.conn.send_bytes(m)
            except OSError as e:
                raise self._fail(f"tensor-parallel rank {w.rank}: send failed: {e}") from e

    def _answers(self, what: str, timeout_s: float) -> list[bytes]:
        """Every worker's answer to the command just sent, in rank order; an error answer comes
        back as ``b"error: ..."`` (every answer read, none left in a pipe). A rank that died or
        did not answer breaks the runner."""
        out = []
        for w in self.workers:
            try:
                out.append(w.answer(timeout_s, what))
            except TensorParallelError as e:
                if isinstance(e, RankAnswerError) and w.death(grace_s=0) is None:
                    out.append(ERROR + str(e).encode())
                    continue
                raise self._fail(str(e)) from e
        return out

    def _in_step(self, fn):
        """Run rank 0's part of a forward the workers were sent; any failure breaks the runner."""
        self.group.step_open = True
        try:
            return fn()
        except Exception as e:
            hint = ""  # a hint only, decided by nothing: gloo's timeout has no type of its own
            if "timed out" in str(e).lower():
                hint = f" (a rank did not answer within {self.timeout_s:g} s)"
            raise self._fail(
                f"tensor-parallel forward failed{hint}: {type(e).__name__}: {e}"
            ) from e
        finally:
            self.group.step_open = False

    def _pool_id(self, pool: KVPool | StatePool | SlotEntry) -> int:
        pid = self._pool_ids.get(pool.states if isinstance(pool, SlotEntry) else pool)
        if pid is None:
            raise ValueError("this pool was not made by this tensor-parallel runner's make_pool")
        return pid

    def _check_tokens(self, ids: list[int]) -> None:
        vocab = self.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"token id outside the vocabulary [0, {vocab})")

    # ---- the ModelRunner interface -----------------------------------------------------------
    def make_pool(
        self, num_pages: int, page_size: int, role="target", num_slots=None, window_pages=None
    ) -> KVPool:
        """The pool on every rank, each its shard (a hybrid model's ``num_slots`` state slots
        too, each rank's holding its state head groups). Its sliding-window entry
        (``pool.window``) and its state slots (``pool.states``) go by ids of their own
        (:meth:`shard_layouts`, :meth:`kv_agents`); slot ids, like page ids, are rank 0's."""
        with self._lock:
            self._check_alive()
            pool = ShardRunner.make_pool(self, num_pages, page_size, role, num_slots, window_pages)
            pid, wid, sid = (next(self._next_id) for _ in range(3))
            slots = None if pool.states is None else pool.states.num_slots
            self._send(
                Command(MAKE_POOL, pid, num_pages, page_size, role, window_pages, wid, slots, sid)
            )
            answers = self._answers(f"making a pool of {num_pages} pages", self.load_timeout_s)
            entries = {pid: pool, wid: pool.window, sid: pool.states}
            entries = {i: e for i, e in entries.items() if e is not None}
            if any(a != OK for a in answers):  # e.g. out of memory on a rank
                self._dead_pools.extend(entries)  # dropped where it was made
                _raise_error_answer(answers)
            for i, entry in entries.items():
                self._pool_ids[entry] = i
                weakref.finalize(entry, self._dead_pools.append, i)
            return pool

    def shard_layouts(self, pool: KVPool | StatePool | SlotEntry) -> list[EntryLayout]:
        """Every rank's layout of ``pool``'s entry (or of its ``pool.window``, or of its state
        slots ``pool.states``), in rank order: its KV heads ``[head_start, head_start +
        kv_heads)`` of ``total_kv_heads`` (GQA; replicated heads appear on several ranks; a
        state entry: its state head groups) and ``base_addr`` in THAT rank's process. MLA: the
        whole latent on every rank."""
        with self._lock:
            self._check_alive()
            self._send(Command(LAYOUT, self._pool_id(pool)))
            answers = self._answers("describing a pool", self.timeout_s)
            _raise_error_answer(answers)
            return [pool.layout] + [replace(pool.layout, **decode_layout(a)) for a in answers]

    def kv_agents(self, pools: dict, config, slots: int, slot_bytes: int) -> list:
        """Start ranks 1..N-1's KV agents (:mod:`kvtransfer.tp.agent`) over their shards of
        ``pools`` (role -> an entry of a pool made here: the pool, its ``window``, its
        ``states`` or their ``pool_entries`` SlotEntry): each its own Mooncake engine
        (``config``, a ``TransferConfig``) and ``slots`` staging slots. Their clients, in rank
        order."""
        from kvtransfer import AgentClient

        with self._lock:
            self._check_alive()
            ids = {role: self._pool_id(p) for role, p in pools.items()}
        clients: list[AgentClient] = []
        try:
            for w in self.workers:
                clients.append(AgentClient(w.kv_conn, w.rank))
                clients[-1].start(config, ids, slots, slot_bytes, self.load_timeout_s)
        except BaseException:
            for c in clients:
                c.close()
            raise
        return clients

    def forward(
        self, pool: KVPool, seqs: list[SeqInput], last_only: bool = False, features: bool = False
    ) -> list[torch.Tensor]:
        _no_features(features)
        with self._lock:
            self._check_alive()
            pid = self._pool_id(pool)
            self._check_pool(pool)
            self._seqs_meta(pool, seqs)
            self._check_tokens([t for s in seqs for t in s.token_ids])
            self._send(Command(FORWARD, pid, last_only=last_only, seqs=_wire(seqs)))
            return self._in_step(lambda: ShardRunner.forward(self, pool, seqs, last_only))

    def prefill_batch(self, pool, seqs, groups=None, on_group=None, features: bool = False):
        _no_features(features)
        with self._lock:
            self._check_alive()
            pid = self._pool_id(pool)
            self._check_pool(pool)
            if not seqs or any(not s.token_ids for s in seqs):
                raise ValueError("prefill needs at least one token per sequence")
            groups = self._check_groups(groups)
            self._seqs_meta(pool, seqs)
            self._check_tokens([t for s in seqs for t in s.token_ids])
            self._send(Command(PREFILL, pid, seqs=_wire(seqs)))
            held: list[BaseException] = []

            def hook(a: int, b: int) -> None:
                if on_group is not None and not held:
                    try:
                        on_group(a, b)
                    except Exception as e:  # re-raised once every rank finished the forward
                        held.append(e)

            out = self._in_step(lambda: ShardRunner.prefill_batch(self, pool, seqs, groups, hook))
            if held:
                raise held[0]
            return out


def _wire(seqs: list[SeqInput]) -> list[tuple]:
    """Each sequence as a FORWARD / PREFILL command carries it (its window pages and state
    slot if any). An input with a root (spec_branches) is refused: the ranks would not copy
    its shared KV."""
    if any(s.root is not None for s in seqs):
        raise ValueError("a tensor-parallel runner takes no input with a root (SeqInput.root)")
    return [wire_seq(s.token_ids, s.start_pos, s.pages, s.window_pages, s.slot) for s in seqs]


def _no_features(features: bool) -> None:
    if features:  # what an EAGLE head reads; load_stage_draft refuses a head with TP first
        raise ValueError("a tensor-parallel runner does not return features (EAGLE heads)")
