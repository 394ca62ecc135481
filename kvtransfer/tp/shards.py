"""One rank's part in moving rank shards between TP sizes (heterogeneous tensor parallelism).

The pieces (which prefill rank sends which heads to which decode rank) come from
:func:`~kvtransfer.memory.layout.shard_pieces`. Each piece of a layer group moves as its staged
stream (units ``(layer, component, page)``, the same on both sides) cut into chunks of at most
one slot (:func:`piece_chunks`): the prefill rank gathers the chunk's head slice into one of its
registered slots and writes the slot with ONE Mooncake write into a decode rank's slot
(:meth:`RankShards.send`); that decode rank scatters the slot into the same units of its own
page list, into the piece's heads only (:meth:`RankShards.receive`). Every rank has its own
Mooncake engine and staging area (its pool shard lives in its own process or GPU).

In a TP stage, ranks 1..N-1 do this through their agent (:mod:`.agent`).
"""

from __future__ import annotations

from ..link.engine import Engine
from ..memory.layout import EntryLayout, ShardPiece, group_units, staging_rows
from ..memory.staging import StagingArea


def piece_chunks(
    piece: ShardPiece, lay: EntryLayout, num_pages: int, layers: range, slot_bytes: int
) -> list[tuple[int, int]]:
    """``(start, count)`` chunks of ``piece``'s staged stream over ``layers`` and ``num_pages``
    pages, each filling at most one slot of ``slot_bytes`` (``lay``: either side's shard)."""
    per = slot_bytes // piece.unit_bytes(lay)
    if per < 1:
        raise ValueError(f"a slot of {slot_bytes} B holds no unit of {piece.unit_bytes(lay)} B")
    units = group_units(lay, num_pages, layers)
    return [(a, min(per, units - a)) for a in range(0, units, per)]


class RankShards:
    """This rank's pool shards (role -> tensor and layout), staging slots and engine."""

    def __init__(
        self,
        engine: Engine,
        tensors: dict,
        layouts: dict[str, EntryLayout],
        slots: int,
        slot_bytes: int,
    ):
        self.engine, self.layouts = engine, layouts
        self.staging = StagingArea(tensors, layouts, slots, slot_bytes)
        engine.register(self.staging.addr, self.staging.nbytes)

    def slot_addr(self, slot: int) -> int:
        return self.staging.slot_addr(slot)

    def gather(
        self, piece: ShardPiece, pages: list[int], layers: range, chunk: tuple[int, int], slot: int
    ) -> int:
        """Gather ``chunk`` of ``piece`` (this rank is its source) from ``pages`` into local
        ``slot``; returns its bytes."""
        lay = self.layouts[piece.role]
        rows = staging_rows(lay, pages, layers, *chunk)
        self.staging.gather(piece.role, rows, slot, heads=(piece.src_off, piece.heads))
        return chunk[1] * piece.unit_bytes(lay)

    def send(
        self,
        piece: ShardPiece,
        pages: list[int],
        layers: range,
        chunk: tuple[int, int],
        slot: int,
        session: str,
        remote_addr: int,
    ) -> bool:
        """:meth:`gather`, then write the slot to ``remote_addr`` of ``session``; True once it
        landed."""
        nbytes = self.gather(piece, pages, layers, chunk, slot)
        return self.engine.write_sync(session, self.slot_addr(slot), remote_addr, nbytes)

    def receive(
        self, piece: ShardPiece, pages: list[int], layers: range, chunk: tuple[int, int], slot: int
    ) -> None:
        """Scatter local ``slot`` (a landed chunk of ``piece``, this rank its destination) into
        the same units of ``pages``, heads ``[dst_off, dst_off + heads)`` only."""
        rows = staging_rows(self.layouts[piece.role], pages, layers, *chunk)
        self.staging.scatter(piece.role, rows, slot, heads=(piece.dst_off, piece.heads))
