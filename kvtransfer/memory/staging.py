"""Staging memory: registered slots that gather (prefill) or scatter (decode) a room's pages.

Why: Mooncake's TCP transport pays ~50-80 us per copy whatever its size (measured with 0.3.13:
6 KB copies 0.05-0.09 GB/s, >= 4 MB copies 1.5-2 GB/s on loopback), and a fragmented page table
makes one copy per page per (layer, component). Gathering a layer group's pages into an 8 MB
slot turns 15,360 copies of 6 KB into 12 writes (SmolLM2, 4K tokens, page 16).

A :class:`StagingArea` owns ``slots x slot_bytes`` bytes on the pools' device, registered with
the engine once, and the pools' tensors seen as rows of ``page_bytes`` (row math:
:func:`~kvtransfer.memory.layout.staging_rows`). Copies are torch ``index_select`` /
``index_copy_``: on CUDA pools they are device copies. ``gather`` orders itself after the
compute fence when that is a CUDA event (stream wait, nothing blocks) and returns a fence of its
own (an event after the gather) that the transfer worker waits for; on CPU the copy is done when
it returns.
``scatter`` returns once the slot may be written again.

torch is imported only here and only when a side is given its pools' tensors, so the package
still imports without torch.
"""

from __future__ import annotations

from .layout import EntryLayout, state_runs


def _torch():
    import torch

    return torch


class StagingArea:
    """``slots`` slots of ``slot_bytes`` next to the pools ``tensors`` (role -> tensor)."""

    def __init__(self, tensors: dict, layouts: dict[str, EntryLayout], slots: int, slot_bytes):
        torch = _torch()
        slot_bytes = -(-slot_bytes // 64) * 64  # every slot 64-byte aligned
        self.slots, self.slot_bytes = slots, slot_bytes
        self.rows, self.layouts = {}, layouts
        self.device = None
        for role, t in tensors.items():
            lay = layouts[role]
            flat = t.reshape(-1).view(torch.uint8) if t.dtype != torch.uint8 else t.reshape(-1)
            if flat.numel() != lay.nbytes or flat.data_ptr() != lay.base_addr:
                raise ValueError(f"entry {role}: tensor is not the pool buffer of its layout")
            # [L * C * num_pages, page_bytes] in the widest element that divides a page:
            # index_copy_ of 8-byte elements runs ~7x faster than of bytes (measured on CPU:
            # 3.0 vs 0.42 GB/s for 6 KB rows)
            word = _word(torch, lay.page_bytes)
            self.rows[role] = flat.view(word).view(-1, lay.page_bytes // word.itemsize)
            if self.device is not None and flat.device != self.device:
                raise ValueError("every pool entry must live on the same device for staging")
            self.device = flat.device
        self.buffer = torch.empty(slots * slot_bytes, dtype=torch.uint8, device=self.device)
        self.addr = self.buffer.data_ptr()
        self.nbytes = slots * slot_bytes
        self._cuda = self.device.type == "cuda"

    def slot_addr(self, slot: int) -> int:
        if not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot} outside [0, {self.slots})")
        return self.addr + slot * self.slot_bytes

    def _source(self, role: str, heads: tuple[int, int] | None):
        """Entry ``role`` as rows, or (``heads`` = (first head, count)) as rows of that head slice
        only: ``[rows, page_size, count, head words]``, a strided view of the pool."""
        rows = self.rows[role]
        if heads is None:
            return rows
        lay, (first, count) = self.layouts[role], heads
        if not (0 <= first and count >= 1 and first + count <= lay.kv_heads):
            raise IndexError(f"heads [{first}, {first + count}) outside [0, {lay.kv_heads})")
        if rows.shape[1] % (lay.page_size * lay.kv_heads):  # a head is not whole words: bytes
            rows = rows.view(_torch().uint8)
        per_token = rows.view(rows.shape[0], lay.page_size, lay.kv_heads, -1)
        return per_token[:, :, first : first + count]

    def _state_parts(self, role: str, heads: tuple[int, int]) -> list:
        """A state entry's rows as bytes, cut to head groups ``heads`` = (first, count): one
        strided view ``[rows, bytes]`` per sub-block (:func:`~.layout.state_runs`)."""
        lay, rows = self.layouts[role], self.rows[role].view(_torch().uint8)
        return [
            rows[:, a * lay.elem_size : (a + n) * lay.elem_size] for a, n in state_runs(lay, *heads)
        ]

    def _sliced_state(self, role: str, heads) -> bool:
        return heads is not None and self.layouts[role].attn == "state"

    def fits(self, role: str, heads: tuple[int, int] | None = None) -> int:
        """How many units of entry ``role`` (whole rows, or their ``heads`` slice) fit in one
        slot (0: too large)."""
        if self._sliced_state(role, heads):
            return self.slot_bytes // sum(p.shape[1] for p in self._state_parts(role, heads))
        src = self._source(role, heads)
        return self.slot_bytes // (src[0].numel() * src.element_size())

    def _slot_rows(self, src, slot: int, count: int):
        """Slot ``slot`` seen as ``count`` contiguous units shaped like ``src``'s."""
        unit = src[0].numel() * src.element_size()
        if count < 1 or count * unit > self.slot_bytes:
            raise IndexError(f"{count} units of {unit} B do not fit a slot of {self.slot_bytes} B")
        off = self.slot_addr(slot) - self.addr
        return self.buffer[off : off + count * unit].view(src.dtype).view(count, *src.shape[1:])

    def _state_slot(self, role: str, heads, slot: int, count: int):
        """Slot ``slot`` as ``count`` units of a state head slice, bytes ``[count, unit]``."""
        unit = sum(p.shape[1] for p in self._state_parts(role, heads))
        if count < 1 or count * unit > self.slot_bytes:
            raise IndexError(f"{count} units of {unit} B do not fit a slot of {self.slot_bytes} B")
        off = self.slot_addr(slot) - self.addr
        return self.buffer[off : off + count * unit].view(count, unit)

    def _index(self, rows: list[int]):
        torch = _torch()
        return torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=False)

    def gather(self, role: str, rows: list[int], slot: int, after=None, heads=None):
        """Copy pool ``rows`` of ``role`` (only ``heads`` = (first head, count) of each, when
        given) into ``slot`` in order; returns a fence or None. ``after``: the compute fence of
        those rows (a CUDA event is waited on by the stream)."""
        torch = _torch()
        if self._cuda and isinstance(after, torch.cuda.Event):
            torch.cuda.current_stream(self.device).wait_event(after)
        if self._sliced_state(role, heads):  # each sub-block's groups, packed in slot order
            out, idx, col = self._state_slot(role, heads, slot, len(rows)), self._index(rows), 0
            for part in self._state_parts(role, heads):
                out[:, col : col + part.shape[1]].copy_(part.index_select(0, idx))
                col += part.shape[1]
        else:
            src = self._source(role, heads)
            torch.index_select(src, 0, self._index(rows), out=self._slot_rows(src, slot, len(rows)))
        if not self._cuda:
            return None
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        return done

    def scatter(self, role: str, rows: list[int], slot: int, heads=None) -> None:
        """Copy ``slot`` into pool ``rows`` of ``role`` (into ``heads`` of each, when given);
        returns once the slot is free again. Nothing else of a row is written."""
        if self._sliced_state(role, heads):  # into each sub-block's groups, nothing else
            src, idx, col = self._state_slot(role, heads, slot, len(rows)), self._index(rows), 0
            for part in self._state_parts(role, heads):
                part.index_copy_(0, idx, src[:, col : col + part.shape[1]])
                col += part.shape[1]
        else:
            dst = self._source(role, heads)
            dst.index_copy_(0, self._index(rows), self._slot_rows(dst, slot, len(rows)))
        if self._cuda:
            _torch().cuda.current_stream(self.device).synchronize()


def _word(torch, page_bytes: int):
    for dtype in (torch.int64, torch.int32, torch.int16):
        if page_bytes % dtype.itemsize == 0:
            return dtype
    return torch.uint8


def is_device_event(fence) -> bool:
    """A CUDA event: the gather's stream waits for it, no thread has to."""
    return type(fence).__name__ == "Event" and type(fence).__module__.startswith("torch.cuda")


def fence_ready(fence) -> bool:
    """A compute fence the gather may follow now: none, a CUDA event, or any object whose
    non-blocking ``query()`` says True."""
    return fence is None or is_device_event(fence) or bool(fence.query())
