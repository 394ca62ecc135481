"""A tensor-parallel rank's KV endpoint, served to rank 0 on a pipe.

A TP stage's rank 0 runs the control plane (KVSender / KVReceiver) and decides every chunk; the KV
of ranks 1..N-1 lives in their own processes (or GPUs). Each of those ranks runs a
:class:`RankAgent` on a thread: its own Mooncake engine, staging slots over its pool shards
(:class:`~kvtransfer.tp.shards.RankShards`) and a session token (:mod:`kvtransfer.link.proof`), and
does its rank's part of a transfer only:

* :class:`Send` (a prefill rank): gather a chunk of a piece (the piece's head slice, see
  :func:`~kvtransfer.memory.layout.shard_pieces`) from this rank's pages into a local slot, then
  write the slot with ONE Mooncake write into a decode rank's slot. A writer thread writes while
  the next chunk is gathered;
* :class:`Scatter` (a decode rank): a chunk that landed in this rank's slot into its heads of
  the room's pages;
* :class:`Write` (a prefill rank, same TP on both sides): direct copies of whole page runs
  from this rank's pool into its decode rank's pool (both registered).

Rank 0 holds an :class:`AgentClient` per rank: commands carry a sequence number and every one
is answered (:class:`Done`) exactly once, its callback run on the client's reader thread.
Commands are msgpack structs, never Python objects. An agent that dies or whose pipe closes
fails every command still waiting, naming the rank.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import asdict
from multiprocessing.connection import Connection

import msgspec

from ..config import TransferConfig
from ..link.engine import Engine, WriteTimeout
from ..link.proof import SessionToken
from ..memory.layout import EntryLayout, ShardPiece, Transfer
from .shards import RankShards

log = logging.getLogger(__name__)
SLOT_WAIT_S = 30.0  # a Send waits this long for a free local slot (the writer frees them)


class Start(msgspec.Struct, tag="start", frozen=True):
    """rank 0 -> agent: open the engine over these pools (role -> pool id on that rank)."""

    config: dict
    pools: dict[str, int]
    slots: int
    slot_bytes: int


class Chunk(msgspec.Struct, frozen=True):
    """``count`` units from ``start`` of ``piece``'s staged stream over ``layers`` of ``pages``."""

    piece: tuple[str, int, int, int, int, int, int]  # ShardPiece fields
    pages: list[int]
    layer_start: int
    layer_stop: int
    start: int
    count: int

    def args(self):
        return (
            ShardPiece(*self.piece),
            self.pages,
            range(self.layer_start, self.layer_stop),
            (self.start, self.count),
        )


class Send(msgspec.Struct, tag="send", frozen=True):
    seq: int
    chunk: Chunk
    session: str
    remote_addr: int


class Scatter(msgspec.Struct, tag="scatter", frozen=True):
    seq: int
    chunk: Chunk
    slot: int


class Write(msgspec.Struct, tag="write", frozen=True):
    """Direct copies from this rank's pool: (local address, remote address, bytes) each."""

    seq: int
    session: str
    transfers: list[tuple[int, int, int]]


class Info(msgspec.Struct, tag="info", frozen=True):
    seq: int


class Stop(msgspec.Struct, tag="stop", frozen=True):
    pass


class AgentInfo(msgspec.Struct, frozen=True):
    session_id: str
    slot_addrs: list[int]
    slot_bytes: int
    proof_addr: int
    proof: bytes
    layouts: dict[str, dict]  # role -> EntryLayout fields of this rank's shard


class Done(msgspec.Struct, tag="done", frozen=True):
    seq: int
    ok: bool
    error: str = ""
    info: AgentInfo | None = None


Command = Start | Send | Scatter | Write | Info | Stop
# the TransferConfig fields an agent's Mooncake engine uses
ENGINE_FIELDS = (
    "host",
    "protocol",
    "rdma_device",
    "num_workers",
    "max_batch_entries",
    "max_inflight_entries",
)
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Command)
_done = msgspec.msgpack.Decoder(Done)


class SlotPool:
    """This rank's free staging slots: the command thread takes one per Send, the writer
    thread gives it back once its write ended."""

    def __init__(self, slots: int):
        self._free: queue.Queue[int] = queue.Queue()
        for s in range(slots):
            self._free.put(s)

    def take(self, timeout_s: float) -> int:
        """A free slot; TimeoutError when none came free within ``timeout_s``."""
        try:
            return self._free.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"no free staging slot in {timeout_s:g} s") from None

    def give(self, slot: int) -> None:
        self._free.put(slot)


class RankAgent:
    """One rank's engine, slots and token over its pool shards ``tensors`` / ``layouts``."""

    def __init__(
        self,
        config: TransferConfig,
        tensors: dict,
        layouts: dict[str, EntryLayout],
        slots: int,
        slot_bytes: int,
    ):
        self.engine = Engine(config)
        for lay in layouts.values():  # direct copies read / land in the pool itself
            self.engine.register(lay.base_addr, lay.nbytes)
        self.shards = RankShards(self.engine, tensors, layouts, slots, slot_bytes)
        self.token = SessionToken(self.engine)
        self._free = SlotPool(slots)
        self._writes: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # one sender on the pipe at a time

    def info(self) -> AgentInfo:
        st = self.shards.staging
        lays = {role: asdict(lay) for role, lay in self.shards.layouts.items()}
        return AgentInfo(
            self.engine.session_id,
            [st.slot_addr(s) for s in range(st.slots)],
            st.slot_bytes,
            self.token.addr,
            self.token.token,
            lays,
        )

    def serve(self, conn: Connection) -> None:
        """Answer ``conn``'s commands until Stop or EOF; then close the engine, once the writer
        thread stopped (a write it started may read this rank's slots until then)."""
        writer = threading.Thread(
            target=self._write_loop, args=(conn,), name="kv-agent-writer", daemon=True
        )
        writer.start()
        try:
            for cmd in _commands(conn):
                self._one(conn, cmd)
        finally:
            self._writes.put(None)
            writer.join(timeout=self.engine.config.transfer_timeout_s + 5)
            if writer.is_alive():
                log.error("KV agent: the writer is still in a write; the engine stays open")
            else:
                self.engine.close()

    def _one(self, conn: Connection, cmd) -> None:
        try:
            if isinstance(cmd, Info):
                self._answer(conn, Done(cmd.seq, True, info=self.info()))
            elif isinstance(cmd, Scatter):
                self.shards.receive(*cmd.chunk.args(), cmd.slot)
                self._answer(conn, Done(cmd.seq, True))
            elif isinstance(cmd, Write):
                xs = [Transfer(*t) for t in cmd.transfers]
                done = lambda ok, seq=cmd.seq: self._answer(conn, Done(seq, ok))  # noqa: E731
                self.engine.submit(cmd.session, xs, done)
            elif isinstance(cmd, Send):
                slot = self._free.take(SLOT_WAIT_S)
                try:
                    nbytes = self.shards.gather(*cmd.chunk.args(), slot)
                except BaseException:
                    self._free.give(slot)
                    raise
                self._writes.put((cmd, slot, nbytes))
            else:
                raise ValueError(f"unexpected {type(cmd).__name__}")
        except Exception as e:
            self._answer(conn, Done(getattr(cmd, "seq", -1), False, f"{type(e).__name__}: {e}"))

    def _write_loop(self, conn: Connection) -> None:
        while (job := self._writes.get()) is not None:
            cmd, slot, nbytes = job
            try:
                ok = self.engine.write_sync(
                    cmd.session, self.shards.slot_addr(slot), cmd.remote_addr, nbytes
                )
                why = "" if ok else f"write to {cmd.session} failed"
            except WriteTimeout as e:  # it may still read the slot: the slot is never reused
                ok, why, slot = False, str(e), None
            if slot is not None:
                self._free.give(slot)
            self._answer(conn, Done(cmd.seq, ok, why))

    def _answer(self, conn: Connection, done: Done) -> None:
        with self._lock:
            try:
                conn.send_bytes(_enc.encode(done))
            except OSError:
                pass  # rank 0 is gone: nobody to tell


def _commands(conn: Connection):
    """Commands from rank 0 until Stop or the pipe's end."""
    while True:
        try:
            cmd = _dec.decode(conn.recv_bytes())
        except (EOFError, OSError):
            return
        if isinstance(cmd, Stop):
            return
        yield cmd


def serve_start(
    conn: Connection,
    pools_of: Callable[[dict[str, int]], tuple[dict, dict]],
    on_start: Callable[[RankAgent], None] | None = None,
) -> None:
    """An agent's thread body in a rank process: wait for :class:`Start` on ``conn``, build the
    agent over ``pools_of(start.pools)`` (tensors, layouts) and serve (``on_start(agent)``
    first, if given). A failed start is answered (seq 0) and the thread waits for the next."""
    for cmd in _commands(conn):
        if not isinstance(cmd, Start):
            continue
        try:
            tensors, layouts = pools_of(cmd.pools)
            agent = RankAgent(
                TransferConfig(**cmd.config), tensors, layouts, cmd.slots, cmd.slot_bytes
            )
        except Exception as e:
            conn.send_bytes(_enc.encode(Done(0, False, f"{type(e).__name__}: {e}")))
            continue
        if on_start is not None:
            on_start(agent)
        conn.send_bytes(_enc.encode(Done(0, True, info=agent.info())))
        agent.serve(conn)
        return


class AgentError(RuntimeError):
    """A rank agent refused to start, died or did not answer."""


class AgentClient:
    """Rank 0's handle on rank ``rank``'s agent (``conn``: its pipe)."""

    def __init__(self, conn: Connection, rank: int):
        self.conn, self.rank = conn, rank
        self.info: AgentInfo | None = None
        self._seq = 0
        self._pending: dict[int, Callable[[bool, str], None]] = {}
        self._lock = threading.Lock()
        self._closed = ""
        self._reader: threading.Thread | None = None

    def start(
        self,
        config: TransferConfig,
        pools: dict[str, int],
        slots: int,
        slot_bytes: int,
        timeout_s: float,
    ) -> AgentInfo:
        """Open the agent (its engine, slots and token); AgentError naming the rank if not."""
        fields = {k: getattr(config, k) for k in ENGINE_FIELDS}  # no secret: no control plane
        self.conn.send_bytes(_enc.encode(Start(fields, pools, slots, slot_bytes)))
        if not self.conn.poll(timeout_s):
            raise AgentError(
                f"tensor-parallel rank {self.rank}: KV agent did not start within {timeout_s:g} s"
            )
        done = _done.decode(self.conn.recv_bytes())
        if not done.ok:
            raise AgentError(f"tensor-parallel rank {self.rank}: KV agent: {done.error}")
        self.info = done.info
        self._reader = threading.Thread(
            target=self._read, name=f"kv-agent-{self.rank}", daemon=True
        )
        self._reader.start()
        return self.info

    def layouts(self) -> dict[str, EntryLayout]:
        return {role: EntryLayout(**kw) for role, kw in self.info.layouts.items()}

    def send(self, chunk: Chunk, session: str, remote_addr: int, done) -> None:
        self._submit(lambda seq: Send(seq, chunk, session, remote_addr), done)

    def scatter(self, chunk: Chunk, slot: int, done) -> None:
        self._submit(lambda seq: Scatter(seq, chunk, slot), done)

    def write(self, session: str, transfers: list, done) -> None:
        """Direct copies (``Transfer`` each) from this rank's pool into ``session``."""
        xs = [(t.src, t.dst, t.length) for t in transfers]
        self._submit(lambda seq: Write(seq, session, xs), done)

    def _submit(self, make, done: Callable[[bool, str], None]) -> None:
        with self._lock:
            if self._closed:
                err = self._closed
            else:
                self._seq += 1
                self._pending[self._seq] = done
                try:
                    self.conn.send_bytes(_enc.encode(make(self._seq)))
                    return
                except OSError as e:
                    self._pending.pop(self._seq, None)
                    err = f"tensor-parallel rank {self.rank}: KV agent pipe failed ({e})"
        done(False, err)

    def _read(self) -> None:
        """Run each answer's callback; one that raises is logged and the reader goes on. When
        the pipe ends (or the reader itself fails), every command still waiting fails."""
        why = f"tensor-parallel rank {self.rank}: KV agent is gone"
        try:
            while True:
                try:
                    d = _done.decode(self.conn.recv_bytes())
                except (EOFError, OSError, msgspec.DecodeError):
                    return
                with self._lock:
                    cb = self._pending.pop(d.seq, None)
                if cb is not None:
                    _run_callback(cb, d.ok, d.error)
        except BaseException as e:
            why = f"tensor-parallel rank {self.rank}: KV agent reader failed ({e!r})"
            log.exception("%s", why)
            raise
        finally:
            self._fail_all(why)

    def _fail_all(self, why: str) -> None:
        with self._lock:
            self._closed = self._closed or why
            pending, self._pending = self._pending, {}
        for cb in pending.values():
            _run_callback(cb, False, why)

    def close(self) -> None:
        try:
            self.conn.send_bytes(_enc.encode(Stop()))
        except OSError:
            pass
        self._fail_all(f"tensor-parallel rank {self.rank}: KV agent closed")


def _run_callback(cb: Callable[[bool, str], None], ok: bool, error: str) -> None:
    try:
        cb(ok, error)
    except Exception:
        log.exception("a KV agent command's callback raised")
