"""Per-sequence state slots of a hybrid model's recurrent layers: one buffer, the page rules.

A recurrent layer (gated DeltaNet, Mamba2) keeps a fixed-size state per sequence instead of KV
per token: the last ``K - 1`` inputs of its causal conv and its recurrent state. Each sequence
holds ONE slot index, the same in every recurrent layer of the model, from admission to its end.

Layout (:class:`StateSpec`; all of it float32, as transformers keeps the recurrent state: the
conv sub-blocks hold values of the model's dtype, exactly)::

    buffer [R, S, E]        R recurrent layers, S slots, E = slot_elems elements
    slot s of recurrent layer r:  bytes [(r * S + s) * E * 4, (r * S + s + 1) * E * 4)
    a slot: its sub-blocks in order, sub-block i = [heads_i, elems_i] at element offset
            sum_{j < i} heads_j * elems_j, head h of it at + h * elems_i
      gated DeltaNet:  conv_q [Hk, dk (K-1)] | conv_k [Hk, dk (K-1)] | conv_v [Hv, dv (K-1)]
                       | recurrent [Hv, dk dv]   (S per value head, [dk, dv] row-major)
      Mamba2:          conv_x [H, P (K-1)] | conv_B [G, N (K-1)] | conv_C [G, N (K-1)]
                       | ssm [H, P N]            (S per head, [P, N] row-major)

A conv sub-block is channel-major: channel c's last ``K - 1`` inputs, oldest first, at
``c * (K - 1)``; a head's channels are consecutive, so each sub-block splits by head (or group)
on its own: a tensor-parallel rank holds heads ``[h0, h1)`` of every sub-block, never a
contiguous cut of the whole ``[q | k | v]`` conv state. :meth:`StateSpec.entry_layout` is the
buffer as a kvtransfer ``state`` entry (``page_size`` 1: a slot is a page of one "token").

Slots follow the page rules: ``alloc`` hands out a zeroed slot from a free list under a lock,
``free`` of a slot that is not allocated raises (a double free is caught where it happens), and
an empty free list raises :class:`OutOfSlotsError` (the engine checks ``num_free`` before).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass

import torch

from kvtransfer import EntryLayout

from .config import ModelConfig

STATE_DTYPE = "float32"
ELEM_BYTES = 4
# slots of a pool made without a count: the engine's default batch. A sequence of
# Qwen3-Next-80B holds 36 gated DeltaNet layers x 2.2 MB (79 MB) whatever its length
DEFAULT_SLOTS = 16


class OutOfSlotsError(RuntimeError):
    def __init__(self, total: int):
        super().__init__(f"state pool out of slots: all {total} are held by live sequences")
        self.total = total


@dataclass(frozen=True)
class StateSegment:
    name: str  # "conv_q" | "conv_k" | "conv_v" | "recurrent" | "conv_x" | "conv_B" | ...
    heads: int  # heads (or Mamba2 groups) it splits into
    elems_per_head: int
    offset: int  # first element inside the slot

    @property
    def elems(self) -> int:
        return self.heads * self.elems_per_head


@dataclass(frozen=True)
class StateSpec:
    """What one slot of every recurrent layer holds: the model's half of the layout."""

    kind: str  # "gated_deltanet" | "mamba2"
    layers: tuple[int, ...]  # model layer of each recurrent layer, in buffer order
    segments: tuple[StateSegment, ...]

    @classmethod
    def of(cls, cfg: ModelConfig) -> StateSpec | None:
        """The spec of ``cfg``'s recurrent layers; None for a model without any."""
        if not cfg.has_recurrent_state:
            return None
        kind, mixer = ("gated_deltanet", cfg.deltanet) if cfg.deltanet else ("mamba2", cfg.mamba)
        segments, offset = [], 0
        for name, heads, elems in mixer.state_segments():
            segments.append(StateSegment(name, heads, elems, offset))
            offset += heads * elems
        return cls(kind, cfg.recurrent_layers, tuple(segments))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def slot_elems(self) -> int:
        """Elements of one slot of one layer (E)."""
        return sum(s.elems for s in self.segments)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot of one layer."""
        return self.slot_elems * ELEM_BYTES

    @property
    def bytes_per_sequence(self) -> int:
        """Bytes a sequence holds across every recurrent layer (whatever its length)."""
        return self.num_layers * self.slot_bytes

    @property
    def groups(self) -> int:
        """Head groups every sub-block splits into alike (the gcd of their head counts): a
        tensor-parallel rank holds whole groups of every sub-block."""
        return math.gcd(*(s.heads for s in self.segments))

    def entry_layout(
        self,
        num_slots: int,
        role: str = "target",
        first_group: int = 0,
        total_groups: int | None = None,
    ) -> EntryLayout:
        """The buffer as a kvtransfer entry ``{role}.state``: one "page" of one "token" a slot,
        its heads the :attr:`groups` (``kvtransfer.memory.layout``: a state entry). A
        tensor-parallel rank's spec (of its shard's heads) is groups ``[first_group,
        first_group + groups)`` of the model's ``total_groups``."""
        g = self.groups
        return EntryLayout(
            role=f"{role}.state",
            attn="state",
            dtype=STATE_DTYPE,
            page_size=1,
            num_layers=self.num_layers,
            num_pages=num_slots,
            kv_heads=g,
            head_dim=self.slot_elems // g,
            head_start=first_group,
            total_kv_heads=g if total_groups is None else total_groups,
            segments=tuple((s.heads // g, s.elems_per_head) for s in self.segments),
        )

    def describe(self) -> dict:
        """The layout in words and numbers (docs, stats, the handshake's names)."""
        return {
            "kind": self.kind,
            "dtype": STATE_DTYPE,
            "layers": list(self.layers),
            "slot_bytes": self.slot_bytes,
            "bytes_per_sequence": self.bytes_per_sequence,
            "segments": [
                {
                    "name": s.name,
                    "heads": s.heads,
                    "offset_bytes": s.offset * ELEM_BYTES,
                    "bytes": s.elems * ELEM_BYTES,
                    "bytes_per_head": s.elems_per_head * ELEM_BYTES,
                }
                for s in self.segments
            ],
        }


class StatePool:
    """The slots of one model: ``slabs`` [R, S, E] float32 (``tensor``, the same memory as the
    entry's ``buffer_shape``, is what a transfer engine registers) and the slot allocator.
    A tensor-parallel rank's pool: its spec is of its shard's heads, and ``first_group`` /
    ``total_groups`` place them in the model's (:meth:`StateSpec.entry_layout`)."""

    def __init__(
        self,
        spec: StateSpec,
        num_slots: int,
        device: str | torch.device = "cpu",
        role="target",
        first_group: int = 0,
        total_groups: int | None = None,
    ):
        if not isinstance(num_slots, int) or num_slots <= 0:
            raise ValueError(f"num_slots must be a positive integer, got {num_slots!r}")
        layout = spec.entry_layout(num_slots, role, first_group, total_groups)
        self.spec = spec
        self.tensor = torch.zeros(layout.buffer_shape(), dtype=torch.float32, device=device)
        self.slabs = self.tensor.view(spec.num_layers, num_slots, spec.slot_elems)
        self.layout = layout.with_pool(num_slots, self.tensor.data_ptr())
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._allocated: set[int] = set()
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)

    @property
    def slots_in_use(self) -> int:
        return self.num_slots - self.num_free

    def holds(self, slot: int) -> bool:
        """Whether ``slot`` is allocated (a sequence owns it)."""
        with self._lock:
            return slot in self._allocated

    def alloc(self) -> int:
        """A free slot, zeroed in every layer (a fresh sequence's state)."""
        with self._lock:
            if not self._free:
                raise OutOfSlotsError(self.num_slots)
            slot = self._free.popleft()
            self._allocated.add(slot)
        self.slabs[:, slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        with self._lock:
            if slot not in self._allocated:
                raise ValueError(f"freeing state slot {slot} that is not allocated (double free?)")
            self._allocated.discard(slot)
            self._free.append(slot)


class SlotEntry:
    """A :class:`StatePool` seen as a pool entry (role ``{model}.state``) by the code that
    allocates, registers and frees a request's pages of every entry: a request holds one
    "page" of it, its slot, whatever its length."""

    def __init__(self, states: StatePool):
        self.states = states
        self.layout, self.tensor, self.num_pages = states.layout, states.tensor, states.num_slots

    def pages_needed(self, num_tokens: int) -> int:
        return 1

    @property
    def num_free(self) -> int:
        return self.states.num_free

    @property
    def pages_in_use(self) -> int:
        return self.states.slots_in_use

    def alloc(self, n: int) -> list[int]:
        return [self.states.alloc() for _ in range(n)]

    def free(self, slots: list[int]) -> None:
        for s in slots:
            self.states.free(s)


def pool_entries(pool) -> dict:
    """Every entry of a model's pool, role -> entry pool: its KV pages (``target``); for a
    model mixing sliding-window and full layers, its sliding layers' pages (``target.window``,
    a KVPool of which a sequence holds only its window's: backends.runtime.window); for a
    hybrid model, its recurrent layers' slots (``target.state``)."""
    entries = {pool.layout.role: pool}
    if getattr(pool, "window", None) is not None:
        entries[pool.window.layout.role] = pool.window
    if getattr(pool, "states", None) is not None:
        entries[pool.states.layout.role] = SlotEntry(pool.states)
    return entries


def slot_of(pages: dict[str, list[int]], model: str = "target") -> int | None:
    """The state slot among a request's pages of every entry (None: a model without one)."""
    slots = pages.get(f"{model}.state")
    return slots[0] if slots else None
