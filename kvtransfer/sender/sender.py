"""Prefill side: claims rooms registered by decode and streams KV layer group by layer group.

Flow of one room (the prefill stage computes a room only once decode holds its pages)::

    prefill expect(room, tokens, on_registered)   the stage queued the request
    decode  --Register(room, session, entries)-->  checked (registration.py), then claimed:
                                       --Ack-->    and on_registered(room) tells the stage
    prefill start_room(room, pages)    the compute thread took the room: its pages
    prefill send_group(room, role, L, fence)       those layers' pages go out once fence is done
    prefill finish(room, first_token)  --Complete--> once every write of the room has landed
    any failure                        --Fail(reason)--> (only once no write is in flight)

``start_room`` before any registration (tests, benchmarks) also works: the room is claimed when
the Register arrives. ``on_release(room, status)`` runs exactly once, when the room has ended
AND no write reading its pages is still in flight, so the caller may then free the pages.
"""

from __future__ import annotations

import logging
import threading
import time

import msgspec
import zmq

from ..config import TransferConfig
from ..control.loop import ControlLoop, ReleaseCallback
from ..control.state import Claim, RoomStatus, SenderRoom
from ..link.engine import Fence
from ..memory.layout import EntryLayout, ShardPiece, group_transfers
from ..protocol import messages as m
from ..protocol.checksum import entry_checksums
from .inbox import Inbox, InboxLinks
from .pieces import goes_direct, plan_pieces, rank_dst
from .registration import RegistrationError, check_entries, dest
from .staging import StagedSends, StagingLinks

log = logging.getLogger(__name__)


def _register_frame_limit(layouts: dict[str, EntryLayout]) -> int:
    """The largest Register a decode can legitimately send to this prefill (all its pages)."""
    return 4096 + sum(512 + 9 * lay.num_pages for lay in layouts.values())


class KVSender(ControlLoop):
    """``tensors`` (role -> the pool's tensor, optional): enables staged transfers for
    fragmented page tables (see :mod:`.staging`). ``agents``: a tensor-parallel stage's ranks
    1..N-1 (:class:`~kvtransfer.tp.agent.AgentClient`, rank order)."""

    name = "kv-sender"

    def __init__(
        self,
        config: TransferConfig,
        layouts: dict[str, EntryLayout],
        tensors: dict | None = None,
        agents: list | None = None,
    ):
        super().__init__(config, layouts, tensors)
        limit = config.max_frame_bytes or _register_frame_limit(self.layouts)
        self.router = self.socket(zmq.ROUTER, limit)
        if config.bootstrap_port:
            self.router.bind(f"tcp://{config.host}:{config.bootstrap_port}")
            port = config.bootstrap_port
        else:
            port = self.router.bind_to_random_port(f"tcp://{config.host}")
        self.bootstrap_addr = f"{config.host}:{port}"
        # tensor parallel: the ranks' KV agents (1..); role -> {rank: its shard's layout}
        self.agents = list(agents or [])
        self.rank_layouts = {role: {0: lay} for role, lay in self.layouts.items()}
        for k, a in enumerate(self.agents, 1):  # an agent holds the entries of its runner
            for role, lay in a.layouts().items():
                self.rank_layouts[role][k] = lay
        area = self.open_staging(tensors, config.staging_slots)
        self.staging = StagedSends(
            config,
            self.layouts,
            area,
            self.engine.slot_writer() if area else None,  # closed by the engine, first
            self.rank_layouts,
            self.agents,
            self.rooms,
            self.transfer_stats,
            StagingLinks(
                reply=lambda ident, msg: self.send(self.router, msg, ident),
                fail=lambda room, reason: self._fail(room, reason, True),
                group_done=self._group_done,
                post=self.call,
                busy=self.has_commands,
            ),
        )
        self.inbox = Inbox(
            self.layouts,
            self.engine,
            self.verifier,
            self.fingerprint,
            self.rooms,
            config.max_pending_per_peer,
            InboxLinks(
                reply=lambda ident, msg, signed: self.send(self.router, msg, ident, signed),
                drop=self.drop,
                refused=self.count_refusal,
                post=self.call,
                claim=self._claim,
                fail=self._fail,
                grant=self._on_grant,
            ),
        )
        self.start()

    # ---- public API (any thread) -------------------------------------------------------------
    def expect(self, room: int, num_tokens: int, on_registered, on_release: ReleaseCallback):
        """The stage queued this room's request: claim decode's Register when it arrives (or
        now) and then call ``on_registered(room)`` on the control thread."""
        self.call_sync(self._expect, room, int(num_tokens), on_registered, on_release)

    def start_room(
        self,
        room: int,
        src_pages: dict[str, list[int]],
        on_release: ReleaseCallback | None = None,
    ) -> None:
        """Prefill computes the room now, into ``src_pages`` (role -> page ids)."""
        for role, pages in src_pages.items():
            if role not in self.layouts:
                raise ValueError(
                    f"room {room}: no local entry {role!r} (have {list(self.layouts)})"
                )
            bad = [p for p in pages if not 0 <= p < self.layouts[role].num_pages]
            if bad:
                raise ValueError(f"room {room}: {role} pages {bad[:4]} outside the pool")
        pages = {r: list(p) for r, p in src_pages.items()}
        self.call_sync(self._start, room, pages, on_release)

    def send_group(self, room: int, role: str, layers: range, fence: Fence | None = None) -> None:
        """Queue the writes of ``layers`` of entry ``role`` (non-blocking for the caller).

        ``fence``: the completion fence of the compute that wrote those layers (a CUDA event;
        None on CPU). A transfer worker waits for it before any byte of the group leaves."""
        lay = self.layouts.get(role)
        if lay is None:
            raise ValueError(f"no local entry {role!r}")
        if not (0 <= layers.start < layers.stop <= lay.num_layers and layers.step == 1):
            raise ValueError(f"layers {layers} outside [0, {lay.num_layers}) of entry {role}")
        self.call(self._send_group, room, role, layers, fence)

    def first_token(self, room: int, token: int) -> None:
        """Send the room's first token to decode now (FirstToken), before its KV landed."""
        self.call(self._first_token, room, int(token))

    def finish(self, room: int, first_token: int, extra: dict | None = None) -> None:
        """Send Complete with the aux data once all queued writes of the room have landed."""
        try:
            extra = msgspec.convert(dict(extra or {}), dict[str, m.ExtraValue])
        except msgspec.ValidationError as e:
            raise ValueError(f"room {room}: extra must map str to int/float/str/list ({e})") from e
        self.call(self._finish, room, int(first_token), extra)

    def abort(self, room: int, reason: str) -> None:
        self.call(self._fail, room, f"aborted by prefill: {reason}", True)

    def is_live(self, room: int) -> bool:
        """The room exists and has not ended (a compute thread checks it between groups)."""
        with self.cond:
            st = self.rooms.status(room)
        return st is not None and not st[0].ended

    def stats(self) -> dict:
        snap = super().stats()
        snap["pending_registrations"] = self.inbox.pending
        snap["staged"] = dict(self.staging.counts)
        return snap

    def close(self) -> None:
        self.inbox.close()
        super().close()  # the engine closes the staging writer first

    # ---- loop thread: the stage's calls --------------------------------------------------------
    def _expect(self, room: int, num_tokens: int, on_registered, on_release) -> None:
        deadline = time.monotonic() + self.config.queue_timeout_s
        r = SenderRoom(
            room=room,
            num_tokens=num_tokens,
            on_registered=on_registered,
            on_release=on_release,
            deadline=deadline,
        )
        self.rooms.add(r)  # KeyError for a room id in use: the caller refuses that request
        self.transfer_stats.room(room)
        self._take_pending(r)

    def _take_pending(self, r: SenderRoom) -> None:
        ended, registration = self.inbox.take(r.room)
        if ended is not None:
            self._fail(r.room, ended, False)
        elif registration is not None:
            self._claim(r, *registration)

    def _start(self, room: int, src_pages: dict[str, list[int]], on_release) -> None:
        r = self.rooms.get(room)
        if r is None:  # the direct flow: no expect(), the pages come first
            if self.rooms.ended(room):
                raise ValueError(f"room {room} already ended")
            r = SenderRoom(room=room, on_release=on_release)
            self.rooms.add(r)
            self.transfer_stats.room(room)
            r.src_pages = src_pages
            r.deadline = time.monotonic() + self.config.bootstrap_timeout_s
            self._take_pending(r)
            return
        if r.status.ended or r.src_pages is not None:
            raise ValueError(f"room {room} is not waiting to start ({r.status.name})")
        r.src_pages = src_pages
        if on_release is not None:
            r.on_release = on_release
        r.deadline = time.monotonic() + self.config.transfer_timeout_s
        if r.claim is not None:
            self._pair_pages(r)

    def _pair_pages(self, r: SenderRoom) -> bool:
        """Keep of each entry's pages (every block of the prompt) the blocks decode registered
        pages for (from its ``first``); fail the room unless the counts are equal."""
        for role, src in (r.src_pages or {}).items():
            n, first = len(r.claim.dst_pages(role)), r.claim.first(role)
            if len(src) - first != n:
                why = f"decode gave {n} {role} pages from block {first} for {len(src)} blocks"
                self._fail(r.room, f"bad page table: {why}", True)
                return False
            r.src_pages[role] = src[first:]
        return True

    def _claim(self, r: SenderRoom, ident: bytes, reg: m.Register) -> None:
        try:
            roles = list(r.src_pages if r.src_pages is not None else self.layouts)
            dst = check_entries(reg, self.layouts, r.num_tokens, roles)
            pieces = plan_pieces(
                reg,
                dst,
                self.rank_layouts,
                1 + len(self.agents),
                self.staging.slot_bytes(),
                self.config.kv_checksum,
            )
        except RegistrationError as e:
            r.claim = Claim(ident, reg, {})  # the Fail goes to this registering peer
            self._fail(r.room, str(e), True)
            return
        r.claim = Claim(ident, reg, dst, pieces)
        if r.src_pages is not None and not self._pair_pages(r):
            return
        self.send(
            self.router, m.Ack(r.room, {k: v.signature() for k, v in self.layouts.items()}), ident
        )
        self.advance(r, RoomStatus.WaitingForInput)
        if r.first_token is not None:
            self.send(self.router, m.FirstToken(r.room, r.first_token), ident)
        if r.src_pages is None:  # registered, waiting for the compute thread (backpressure)
            r.deadline = time.monotonic() + self.config.queue_timeout_s
        else:
            r.deadline = time.monotonic() + self.config.transfer_timeout_s
        queued, r.queued = r.queued, []
        for role, layers, fence in queued:
            self._launch(r, role, layers, fence)
        self._maybe_complete(r)
        if r.on_registered is not None and not r.status.ended:
            try:
                r.on_registered(r.room)
            except Exception:
                log.exception("kv-sender: on_registered(%d) failed", r.room)

    def _send_group(self, room: int, role: str, layers: range, fence) -> None:
        r = self.rooms.get(room)
        if r is None and not self.rooms.ended(room):
            log.warning("kv-sender: send_group for unknown room %d ignored", room)
        if r is None or r.status.ended:
            return  # the room already ended; its release callback has run / will run
        if r.src_pages is None or role not in r.src_pages:
            self._fail(room, f"send_group for entry {role!r} the room has no pages in", True)
        elif r.claim is None:
            r.queued.append((role, layers, fence))
        else:
            self._launch(r, role, layers, fence)

    def _launch(self, r: SenderRoom, role: str, layers: range, fence=None) -> None:
        """Queue one layer group's writes: direct copies (per tensor-parallel piece, or one set
        for one rank each side) or through staging (few large writes instead of many copies)."""
        fence = self.faults.delayed(fence)
        pieces = r.claim.pieces[role] if r.claim.pieces else [None]
        try:  # staged or direct is decided first: 245,760 copy objects cost ~0.5 s at page 1
            direct = [
                (p, self._transfers(r, role, layers, p))
                for p in pieces
                if self._goes_direct(r, role, p, fence)
            ]
        except (ValueError, IndexError) as e:
            self._fail(r.room, f"bad page table: {e}", True)
            return
        staged = [p for p in pieces if not any(p is q for q, _ in direct)]
        r.outstanding += len(direct) + bool(staged)
        self.advance(r, RoomStatus.Transferring)
        if r.claim.pieces is None and self.faults.fails(r.room):  # a write that fails late
            fail = (self.call, self._group_done, r.room, role, layers, False)
            threading.Timer(self.faults.delay_s, fail[0], fail[1:]).start()
            return
        for p, transfers in direct:
            self._submit(r, role, layers, fence, p, transfers)
        if staged:
            self.staging.add_group(r, role, layers, fence, staged if r.claim.pieces else None)

    def _goes_direct(self, r: SenderRoom, role: str, p: ShardPiece | None, fence) -> bool:
        if p is None:
            return not self.staging.wanted(r, role)
        src, dst = self.rank_layouts[role][p.src], rank_dst(r.claim, role, p.dst)
        return goes_direct(
            p,
            src,
            dst,
            r.src_pages[role],
            r.claim.dst_pages(role),
            fence,
            self.config.staging_min_copy_bytes,
        )

    def _transfers(self, r: SenderRoom, role: str, layers: range, p: ShardPiece | None):
        src, dst = (p.src, p.dst) if p is not None else (0, 0)
        return group_transfers(
            self.rank_layouts[role][src],
            rank_dst(r.claim, role, dst),
            r.src_pages[role],
            r.claim.dst_pages(role),
            layers,
        )

    def _submit(self, r: SenderRoom, role: str, layers: range, fence, p, transfers) -> None:
        """Direct copies of one group (of one piece): from rank 0 through this engine, from
        rank k through its agent."""
        g = self.transfer_stats.group_submitted(
            r.room, role, layers, sum(t.length for t in transfers), len(transfers)
        )
        src = p.src if p is not None else 0
        room, session = r.room, dest(r.claim.reg, p.dst if p is not None else 0)[0]

        def done(ok: bool, error: str = "") -> None:  # a transfer worker / the agent's reader
            if not ok and error:
                log.warning("room %d: rank %d's direct copies failed: %s", room, src, error)
            self.transfer_stats.group_done(g, ok)
            self.call(self._group_done, room, role, layers, ok)

        try:
            if src == 0:
                self.engine.submit(session, transfers, done, fence, lambda: self.is_live(room))
            else:
                self.agents[src - 1].write(session, transfers, done)
        except Exception as e:  # e.g. the engine closed: this group fails, the loop goes on
            log.warning("room %s: submitting layers %s failed: %s", room, layers, e)
            done(False)

    def _group_done(self, room: int, role: str, layers: range, ok: bool) -> None:
        r = self.rooms.get(room)
        if r is None:
            return
        r.outstanding -= 1
        if not ok:
            where = f"{role} layers {layers.start}-{layers.stop - 1}"
            self._fail(room, f"transfer failed: {where} to {r.claim.reg.session_id}", True)
        if not r.status.ended:
            self._maybe_complete(r)
        elif r.outstanding == 0:
            self._drained(r)

    def _first_token(self, room: int, token: int) -> None:
        r = self.rooms.get(room)
        if r is None or r.status.ended:
            return
        if r.claim is None:
            r.first_token = token  # goes out right after the Ack
        else:
            self.send(self.router, m.FirstToken(room, token), r.claim.ident)

    def _finish(self, room: int, first_token: int, extra: dict) -> None:
        r = self.rooms.get(room)
        if r is None or r.status.ended:
            return
        r.finish = (first_token, extra)
        self._maybe_complete(r)

    def _maybe_complete(self, r: SenderRoom) -> None:
        if r.status.ended or r.finish is None or r.claim is None:
            return
        if r.outstanding or r.queued:
            return
        first_token, extra = r.finish
        sums = {}
        if self.config.kv_checksum:  # every write landed: the source pages are what was sent
            sums = {
                role: entry_checksums(self.layouts[role], self.pool_tensors[role], pages)
                for role, pages in (r.src_pages or {}).items()
            }
        self.send(self.router, m.Complete(r.room, first_token, extra, sums), r.claim.ident)
        self.advance(r, RoomStatus.Success)
        self.release(r)

    def _fail(self, room: int, reason: str, tell_decode: bool) -> None:
        r = self.rooms.get(room)
        if r is None or not self.advance(r, RoomStatus.Failed, reason):
            return
        r.tell_decode = tell_decode
        if self.staging.active:
            self.staging.pump()  # its staged groups not in flight end now
        if r.outstanding == 0:
            self._drained(r)

    def _drained(self, r: SenderRoom) -> None:
        """A failed room has no write in flight any more: only now may decode reuse its pages,
        so the Fail goes out here (never earlier), then this side's pages are released."""
        if r.tell_decode and r.claim is not None:
            self.send(self.router, m.Fail(r.room, r.reason), r.claim.ident)
        self.release(r)

    def release(self, r: SenderRoom) -> None:
        super().release(r)
        if r.released:
            self.staging.forget(r.room)

    def on_tick(self, now: float) -> None:
        if self.staging.active:
            self.staging.pump()  # compute fences of staged groups are polled here
        self.inbox.expire(now, self.config.bootstrap_timeout_s)  # nobody here took them
        for r in list(self.rooms.live.values()):
            if r.status.ended or now <= r.deadline:
                continue
            try:
                self._timeout(r)
            except Exception:  # one room's trouble never stops the others' timeouts
                self.loop_errors += 1
                log.exception("kv-sender: timing out room %d failed", r.room)

    def on_frames(self, sock: zmq.Socket, frames: list[zmq.Frame]) -> None:
        self.inbox.on_frames(frames)

    def _on_grant(self, ident: bytes, g: m.Grant) -> None:
        dropped = self.staging.on_grant(ident, g)
        if dropped:
            self.drop("unexpected", dropped)

    def _timeout(self, r: SenderRoom) -> None:
        cfg = self.config
        if r.claim is None and r.src_pages is None:
            why = f"queue timeout: decode did not register in {cfg.queue_timeout_s:g}s"
        elif r.claim is None:
            why = f"bootstrap timeout: decode did not register in {cfg.bootstrap_timeout_s:g}s"
        elif r.src_pages is None:
            why = f"queue timeout: not computed {cfg.queue_timeout_s:g}s after decode registered"
        else:
            why = f"transfer timeout: room not finished {cfg.transfer_timeout_s:g}s after start"
        self._fail(r.room, why, True)
