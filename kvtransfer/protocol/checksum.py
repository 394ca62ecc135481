"""End-to-end KV integrity (opt-in, ``TransferConfig.kv_checksum``): CRC32C per entry and layer.

For a room's pages ``P`` of one entry, layer ``l``'s checksum is CRC32C over the bytes of
(layer ``l``, component 0, pages ``P`` in list order), then component 1, ... — the same bytes,
in the same order, on both sides whatever the page ids are, because position ``i`` of prefill's
page list lands in position ``i`` of decode's (direct copies and staged chunks alike, see
layout.py). Prefill computes them from its source pages once every write of the room landed and
sends them in ``Complete``; decode recomputes them from its own pages when ``Complete`` arrives
(after the scatter of every staged chunk: the scatters run on the same thread, in order, before
``Complete`` is read) and before the room may join decoding. Whole pages are summed, so the
bytes past the prompt in the last page (copied too) count as well.

Cost (measured on the 2-core CI machine, load ~2.9, ``python -m benchmarks.transfer --layouts
smollm2-gqa --page-sizes 16 --dtype float32 --requests 3 --checksum``): a 4K-token SmolLM2 room
(189 MB of KV) takes 14 ms per side with a contiguous page table (13 GB/s, the hardware CRC32C
of the ``crc32c`` package), 29 ms fragmented (15,360 page runs); both sides together are 21 % /
22 % of that request's transfer time without checksum over loopback (1.4 / 0.7 GB/s).
"""

from __future__ import annotations

from ..memory.layout import EntryLayout, page_runs

ALGORITHM = "crc32c"


def _crc32c():
    try:
        import crc32c
    except ImportError as e:  # pragma: no cover - a dependency of the project
        raise ImportError("kv_checksum needs the crc32c package: pip install crc32c") from e
    return crc32c.crc32c


def entry_checksums(lay: EntryLayout, tensor, pages: list[int]) -> list[int]:
    """One CRC32C per layer of the entry over ``pages`` (``tensor``: the entry's pool tensor,
    contiguous, on any device). On CPU the page runs are summed in place (a numpy view: no
    copy); on a GPU each layer's pages are gathered on the device and copied to the host once."""
    import torch

    flat = tensor.view(torch.uint8).reshape(-1)
    if flat.device.type == "cpu":
        return sums_in_place(lay, flat.numpy(), pages)
    return sums_gathered(lay, flat, pages)


def sums_in_place(lay: EntryLayout, host, pages: list[int]) -> list[int]:
    crc32c, runs, out = _crc32c(), page_runs(pages), []
    for layer in range(lay.num_layers):
        crc = 0
        for comp in range(lay.components):
            slab = lay.slab_addr(layer, comp) - lay.base_addr
            for first, n in runs:
                off = slab + first * lay.page_bytes
                crc = crc32c(host[off : off + n * lay.page_bytes], crc)
        out.append(crc)
    return out


def sums_gathered(lay: EntryLayout, flat, pages: list[int]) -> list[int]:
    import torch

    crc32c, out = _crc32c(), []
    rows = flat.view(-1, lay.page_bytes)  # row (layer * components + comp) * num_pages + page
    idx = torch.tensor(pages, dtype=torch.long, device=flat.device)
    for layer in range(lay.num_layers):
        first = layer * lay.components * lay.num_pages
        sel = torch.cat([idx + first + c * lay.num_pages for c in range(lay.components)])
        out.append(crc32c(rows.index_select(0, sel).cpu().numpy(), 0))
    return out


def first_mismatch(role: str, sent: list[int], mine: list[int]) -> str | None:
    """The error for the first layer whose checksums differ (None: all equal)."""
    if len(sent) != len(mine):
        return f"KV checksum mismatch: {role}: {len(sent)} layer checksums, {len(mine)} layers"
    for layer, (a, b) in enumerate(zip(sent, mine, strict=True)):
        if a != b:
            return (
                f"KV checksum mismatch: {role} layer {layer} (prefill {a:08x}, decode {b:08x}):"
                " the bytes that landed are not the bytes prefill computed"
            )
    return None


def verify_room(
    layouts: dict[str, EntryLayout],
    tensors: dict,
    pages: dict[str, list[int]],
    sent: dict[str, list[int]],
    flip: bool = False,
) -> str | None:
    """Decode's check of a room: every entry it registered (``pages``) against prefill's
    checksums ``sent``; ``flip``: corrupt the landed bytes first (fault injection)."""
    missing = sorted(set(pages) - set(sent))
    if missing:
        return (
            f"KV checksum missing for {missing}: prefill sent none (kv_checksum must be on in"
            " both stages)"
        )
    if flip:
        role = next(iter(pages))
        flip_one_byte(layouts[role], tensors[role], pages[role])
    for role, p in pages.items():
        bad = first_mismatch(role, sent[role], entry_checksums(layouts[role], tensors[role], p))
        if bad:
            return bad
    return None


def flip_one_byte(lay: EntryLayout, tensor, pages: list[int]) -> None:
    """Fault injection (``KVTRANSFER_FAULTS=flip=P``): flip the low bit of the first byte of
    the room's first page of layer 0, as a corrupted write would."""
    import torch

    flat = tensor.view(torch.uint8).reshape(-1)
    off = lay.slab_addr(0, 0) - lay.base_addr + pages[0] * lay.page_bytes
    flat[off] ^= 1
