"""Prefill's tensor-parallel rooms: a room with more than one rank on either side (decisions
only; :class:`~kvtransfer.sender.sender.KVSender` acts on them).

At the claim, :func:`plan_pieces` pairs the ranks (:func:`~.registration.check_ranks`: which
prefill rank sends which heads of which entry to which decode rank) and refuses what cannot
move: a slot too small for a page of a piece, ``kv_checksum`` (it covers rank 0's pages only).
Each layer group then goes piece by piece:

* a piece that is a whole shard on both sides (same TP) into a decode rank that declared its
  pool, with page runs long enough (``staging_min_copy_bytes``, as for one rank), goes as
  direct copies rank to rank (:func:`goes_direct`): from rank 0 through the sender's engine,
  from rank k through its agent (:class:`~kvtransfer.tp.agent.Write`; with a device fence,
  staged instead: only rank 0's stream can wait on it);
* the others through staging (:mod:`.staging`): head slices gathered into slots, one write per
  slot, scattered by the decode rank.

Every piece counts as one outstanding group of the room, so Complete goes out only after every
rank's writes landed; a failed piece fails the room.
"""

from __future__ import annotations

from dataclasses import replace

from ..control.state import Claim
from ..memory.layout import EntryLayout, ShardPiece, mean_copy_bytes
from ..memory.staging import is_device_event
from ..protocol import messages as m
from .registration import RegistrationError, check_ranks, check_slots

RankLayouts = dict[str, dict[int, EntryLayout]]  # role -> {prefill rank: its shard's layout}


def plan_pieces(
    reg: m.Register,
    dst: dict[str, EntryLayout],
    rank_layouts: RankLayouts,
    prefill_ranks: int,
    slot_bytes: list[int] | None,
    kv_checksum: bool,
) -> dict | None:
    """Which rank sends which heads where, every head covered, or RegistrationError. None: one
    rank on each side. ``slot_bytes``: each prefill rank's staging slot (None: no staging)."""
    pieces = check_ranks(reg, dst, rank_layouts)
    if prefill_ranks == 1 and not reg.ranks:
        return None
    if slot_bytes is None or not reg.staging_slots:
        raise RegistrationError(
            "tensor-parallel transfer needs staging on both sides (staging_slot_bytes > 0)"
        )
    if kv_checksum:
        raise RegistrationError(
            "kv_checksum does not cover tensor-parallel ranks yet: turn it off for TP stages"
        )
    check_slots(reg, dst, pieces)
    if any(p.unit_bytes(dst[role]) > slot_bytes[p.src] for role, ps in pieces.items() for p in ps):
        raise RegistrationError(
            "a page does not fit prefill's staging slots: raise staging_slot_bytes"
        )
    return pieces


def rank_dst(claim: Claim, role: str, rank: int) -> EntryLayout | None:
    """Decode rank ``rank``'s layout of entry ``role`` (its pool: None if not declared)."""
    lay = claim.dst[role]
    if rank == 0:
        return lay
    d = claim.reg.ranks[rank - 1]
    if role not in d.pools:
        return None
    (first, count), (base, pages) = d.heads[role], d.pools[role]
    return replace(lay, head_start=first, kv_heads=count, base_addr=base, num_pages=pages)


def goes_direct(
    p: ShardPiece,
    src: EntryLayout,
    dst: EntryLayout | None,
    src_pages: list[int],
    dst_pages: list[int],
    fence,
    min_copy_bytes: int,
) -> bool:
    """Piece ``p`` goes as direct copies: whole rows on both sides of a declared pool, page runs
    long enough, and (from a rank past 0) no device fence to wait on."""
    if dst is None or not p.whole(src, dst) or (p.src and is_device_event(fence)):
        return False
    mean = mean_copy_bytes(src, src_pages, dst_pages)
    return mean >= min(min_copy_bytes, len(src_pages) * src.page_bytes)
