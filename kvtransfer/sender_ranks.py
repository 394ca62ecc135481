"""Prefill's tensor-parallel rooms (a mixin of :class:`~kvtransfer.sender.KVSender`, control
thread): a room with more than one rank on either side.

At the claim, :meth:`stage_pieces` pairs the ranks (:func:`~.registration.check_ranks`: which
prefill rank sends which heads of which entry to which decode rank) and refuses what cannot
move: a slot too small for a page of a piece, ``kv_checksum`` (it covers rank 0's pages only).
Each layer group then goes piece by piece (:meth:`tp_launch`):

* a piece that is a whole shard on both sides (same TP) into a decode rank that declared its
  pool, with page runs long enough (``staging_min_copy_bytes``, as for one rank), goes as
  direct copies rank to rank: from rank 0 through this engine, from rank k through its agent
  (:class:`~.rank_agent.Write`; with a device fence, staged instead: only rank 0's stream can
  wait on it);
* the others through staging (:mod:`.sender_staging`): head slices gathered into slots, one
  write per slot, scattered by the decode rank.

Every piece counts as one outstanding group of the room, so Complete goes out only after every
rank's writes landed; a failed piece fails the room.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from . import messages as m
from .layout import ShardPiece, group_transfers, mean_copy_bytes
from .registration import RegistrationError, check_ranks, check_slots, dest
from .staging import is_device_event
from .state import RoomStatus

log = logging.getLogger(__name__)


class SenderRanks:
    def stage_pieces(self, reg: m.Register, dst: dict) -> dict | None:
        """Tensor parallel (ranks 1.. on either side): which rank sends which heads where,
        every head covered, or RegistrationError. None: one rank each side."""
        pieces = check_ranks(reg, dst, self.rank_layouts)
        if not self.agents and not reg.ranks:
            return None
        if self.staging is None or not reg.staging_slots:
            raise RegistrationError("tensor-parallel transfer needs staging on both sides"
                                    " (staging_slot_bytes > 0)")  # fmt: skip
        if self.config.kv_checksum:
            raise RegistrationError("kv_checksum does not cover tensor-parallel ranks yet:"
                                    " turn it off for TP stages")  # fmt: skip
        check_slots(reg, dst, pieces)
        mine = [self.staging.slot_bytes] + [a.info.slot_bytes for a in self.agents]
        if any(p.unit_bytes(dst[role]) > mine[p.src] for role, ps in pieces.items() for p in ps):
            raise RegistrationError("a page does not fit prefill's staging slots: raise"
                                    " staging_slot_bytes")  # fmt: skip
        return pieces

    def tp_launch(self, r, role: str, layers: range, fence) -> None:
        """One layer group of a TP room: direct pieces, then the staged ones as one task set."""
        try:
            direct = [p for p in r.claim.pieces[role] if self._direct_ok(r, role, p, fence)]
        except (ValueError, IndexError) as e:
            self._fail(r.room, f"bad page table: {e}", True)
            return
        staged = [p for p in r.claim.pieces[role] if p not in direct]
        self.advance(r, RoomStatus.Transferring)
        r.outstanding += len(direct) + bool(staged)
        for p in direct:
            self._direct_piece(r, role, layers, fence, p)
        if staged:
            self.stage_group(r, role, layers, fence, staged)

    def rank_dst(self, r, role: str, rank: int):
        """Decode rank ``rank``'s layout of entry ``role`` (its pool: None if not declared)."""
        lay = r.claim.dst[role]
        if rank == 0:
            return lay
        d = r.claim.reg.ranks[rank - 1]
        if role not in d.pools:
            return None
        (first, count), (base, pages) = d.heads[role], d.pools[role]
        return replace(lay, head_start=first, kv_heads=count, base_addr=base, num_pages=pages)

    def _direct_ok(self, r, role: str, p: ShardPiece, fence) -> bool:
        src, dst = self.rank_layouts[role][p.src], self.rank_dst(r, role, p.dst)
        if dst is None or not p.whole(src, dst) or (p.src and is_device_event(fence)):
            return False
        pages = r.src_pages[role]
        mean = mean_copy_bytes(src, pages, r.claim.dst_pages(role))
        return mean >= min(self.config.staging_min_copy_bytes, len(pages) * src.page_bytes)

    def _direct_piece(self, r, role: str, layers: range, fence, p: ShardPiece) -> None:
        src, dst = self.rank_layouts[role][p.src], self.rank_dst(r, role, p.dst)
        transfers = group_transfers(src, dst, r.src_pages[role], r.claim.dst_pages(role), layers)
        g = self.transfer_stats.group_submitted(
            r.room, role, layers, sum(t.length for t in transfers), len(transfers)
        )
        room, session = r.room, dest(r.claim.reg, p.dst)[0]

        def done(ok: bool, error: str = "") -> None:  # a transfer worker / the agent's reader
            if not ok and error:
                log.warning("room %d: rank %d's direct copies failed: %s", room, p.src, error)
            self.transfer_stats.group_done(g, ok)
            self.call(self._group_done, room, role, layers, ok)

        try:
            if p.src == 0:
                self.engine.submit(session, transfers, done, fence, lambda: self.is_live(room))
            else:
                self.agents[p.src - 1].write(session, transfers, done)
        except Exception as e:  # e.g. the engine closed: this piece fails, the loop goes on
            log.warning("room %s: submitting layers %s failed: %s", room, layers, e)
            done(False)
