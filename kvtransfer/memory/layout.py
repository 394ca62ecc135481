"""KV pool layouts and all address math (the one module that turns pages into bytes).

A KV pool holds one or more *entries*: the state of one model's layers of one kind (the target
model and, with speculative decoding, the draft model). A model's full-attention layers are entry
``target`` (or ``draft``); a hybrid model adds ``target.window`` (its sliding-window layers) and
``target.state`` (its recurrent layers). Each entry lives in ONE contiguous buffer so it is
registered with the transfer engine once:

* GQA / MHA entry  (``attn == "gqa"``), buffer shape
  ``[num_layers, 2, num_pages, page_size, kv_heads, head_dim]`` — per layer K then V, each
  ``[pages, page_size, kv_heads, head_dim]``.
* MLA entry (``attn == "mla"``), buffer shape ``[num_layers, num_pages, page_size, latent_dim]``
  with ``latent_dim = kv_lora_rank + rope_dim`` — the compressed latent as DeepSeek caches it.
* A sliding-window entry (``window > 0``, GQA or MLA): the same buffer, but a sequence holds only
  the pages its last ``window`` tokens reach, so a room moves (and decode holds) only the pages
  of blocks ``[first, last]`` of :meth:`EntryLayout.pages_for`.
* A state entry (``attn == "state"``): one fixed-size *slot* per sequence per layer (the conv and
  recurrent state of a gated DeltaNet or Mamba2 layer), buffer shape
  ``[num_layers, num_slots, kv_heads * head_dim]``: the address math of a GQA entry with
  ``page_size = 1`` and one component (a slot is a "page" of one "token"), and a room holds
  exactly one slot. Its heads are *groups*: every sub-block of the slot splits into
  ``total_kv_heads`` equal groups of heads (a DeltaNet's ``q``/``k`` conv channels, ``v`` conv
  channels, recurrent state; a Mamba2's ``x``, ``B``, ``C`` channels, SSM state), and a
  tensor-parallel rank holds groups ``[head_start, head_start + kv_heads)`` of every sub-block.
  ``segments`` are the sub-blocks in slot order, ``(heads per group, elems per head)`` each, so
  ``head_dim`` is one group's elements; the slot is sub-block major: sub-block ``s`` starts at
  element ``kv_heads * sum_{j<s} h_j e_j`` and group ``g`` of it ``g * h_s e_s`` further
  (:func:`state_runs`).

A *component* is one ``[pages, page_size, ...]`` slab of one layer: GQA layers have two (K, V),
MLA layers one. The bytes of page ``p`` of (layer, component) start at
``base_addr + ((layer * components + component) * num_pages + p) * page_bytes``.

Staging (fragmented page tables): the entry buffer is also seen as *rows* of ``page_bytes``,
row ``(layer * components + component) * num_pages + page``. A layer group ``[a, b)`` of a room
with page list ``P`` (``n = len(P)``) is the stream of units ``u in [0, (b - a) * components * n)``
with ``layer = a + u // (components * n)``, ``component = (u // n) % components``,
``page = P[u % n]``. A staged chunk is the run of units ``[start, start + count)``: prefill
gathers those rows (its own ``P``) into one registered slot, one write moves the slot, and decode
scatters the slot into the same units of ITS ``P`` (:func:`staging_rows` on both sides), so a
chunk can only ever land in pages decode registered for that room.

Tensor parallelism: each rank's shard of an entry is an :class:`EntryLayout` of its own (its
``base_addr`` in that rank's process) whose ``head_start`` / ``kv_heads`` of ``total_kv_heads``
say which KV heads it holds (GQA; a head is replicated on several ranks when the TP size exceeds
the heads; MLA: every rank holds the whole latent). :func:`shard_pieces` decides which prefill
rank sends which heads to which decode rank: every head of every decode shard from exactly one
prefill rank (the lowest one holding it), MLA only from prefill rank 0, once per decode rank.
Within a page a head slice is ``page_size`` strided runs, so a piece that is not a whole shard
goes through staging: its unit is still one (layer, component, page) row, but only heads
``[src_off, src_off + heads)`` of the source row are gathered and they land at heads
``[dst_off, dst_off + heads)`` of the destination row
(:class:`~kvtransfer.memory.staging.StagingArea`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}
SCALED_DTYPES = ("float8_e4m3fn",)  # stored as value / 2 ** scale_log2[layer, component]
ATTN_KINDS = ("gqa", "mla", "state")
MODELS = ("target", "draft")
PARTS = ("window", "state")  # a hybrid model's other entries: ``target.window``, ``target.state``
ROLES = MODELS + tuple(f"{m}.{p}" for m in MODELS for p in PARTS)


@dataclass(frozen=True)
class EntryLayout:
    """Layout of one pool entry (one model's KV cache).

    Compatibility between two sides is decided by :meth:`signature` (everything but the
    pool-local fields ``num_pages`` and ``base_addr``).
    """

    role: str  # "target" | "draft"
    attn: str  # "gqa" | "mla"
    dtype: str  # key of DTYPE_SIZES
    page_size: int  # tokens per page
    num_layers: int
    num_pages: int  # pages in this pool (local)
    kv_heads: int = 1  # GQA: KV heads held here; MLA: 1
    head_dim: int = 0  # GQA: head dim; MLA: kv_lora_rank + rope_dim
    kv_lora_rank: int = 0  # MLA only
    rope_dim: int = 0  # MLA only
    head_start: int = 0  # first KV head held (tensor parallel)
    total_kv_heads: int = 0  # KV heads of the whole model (0: same as kv_heads)
    scale_log2: tuple[int, ...] = ()  # fp8: log2 of each (layer, component)'s scale
    window: int = 0  # sliding window (tokens): only the window's pages move; 0: all
    segments: tuple[tuple[int, int], ...] = ()  # state: (heads, elems per head) per sub-block
    base_addr: int = 0  # address of the entry's buffer (local)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role {self.role!r} not in {ROLES}")
        if self.attn not in ATTN_KINDS:
            raise ValueError(f"attn {self.attn!r} not in {ATTN_KINDS}")
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"dtype {self.dtype!r} not in {sorted(DTYPE_SIZES)}")
        for name in ("page_size", "num_layers", "num_pages", "kv_heads", "head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.attn == "mla":
            if self.kv_heads != 1:
                raise ValueError("an MLA entry caches one latent per token: kv_heads must be 1")
            if self.kv_lora_rank <= 0 or self.kv_lora_rank + self.rope_dim != self.head_dim:
                raise ValueError(
                    f"MLA head_dim ({self.head_dim}) must equal kv_lora_rank ({self.kv_lora_rank})"
                    f" + rope_dim ({self.rope_dim}), with kv_lora_rank > 0"
                )
        object.__setattr__(self, "segments", tuple(tuple(x) for x in self.segments))
        if self.attn == "state":
            self._check_state()
        elif self.segments:
            raise ValueError("segments describe a state entry's slot only")
        if (
            not isinstance(self.window, int)
            or self.window < 0
            or (self.window and self.attn == "state")
        ):
            raise ValueError(
                f"window must be an integer >= 0 (0 for a state entry), got {self.window!r}"
            )
        if self.total_kv_heads and self.head_start + self.kv_heads > self.total_kv_heads:
            raise ValueError("head_start + kv_heads exceeds total_kv_heads")
        object.__setattr__(self, "scale_log2", tuple(self.scale_log2))  # a signature's list
        want = self.num_layers * self.components if self.dtype in SCALED_DTYPES else 0
        if len(self.scale_log2) != want or not all(
            isinstance(e, int) and -64 <= e <= 64 for e in self.scale_log2
        ):
            raise ValueError(
                f"scale_log2 must hold {want} integer exponents in [-64, 64] for a"
                f" {self.dtype} entry of {self.num_layers} layers, got {self.scale_log2!r}"
            )

    def _check_state(self) -> None:
        if self.page_size != 1:
            raise ValueError("a state entry has page_size 1 (a slot per sequence)")
        elems = sum(h * e for h, e in self.segments)
        if not self.segments or any(h < 1 or e < 1 for h, e in self.segments):
            raise ValueError(
                f"a state entry needs segments of >= 1 head and element, got {self.segments!r}"
            )
        if elems != self.head_dim:
            raise ValueError(
                f"segments hold {elems} elements, head_dim (a group's elements) is {self.head_dim}"
            )

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def components(self) -> int:
        """Slabs per layer: 2 (K, V) for GQA, 1 (latent) for MLA."""
        return 2 if self.attn == "gqa" else 1

    @property
    def elem_size(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def token_bytes(self) -> int:
        """Bytes of one token in one component of one layer."""
        return self.kv_heads * self.head_dim * self.elem_size

    @property
    def page_bytes(self) -> int:
        """Bytes of one page in one component of one layer (the stride between pages)."""
        return self.page_size * self.token_bytes

    @property
    def nbytes(self) -> int:
        """Size of the whole entry buffer."""
        return self.num_layers * self.components * self.num_pages * self.page_bytes

    def buffer_shape(self) -> tuple[int, ...]:
        if self.attn == "gqa":
            return (
                self.num_layers,
                2,
                self.num_pages,
                self.page_size,
                self.kv_heads,
                self.head_dim,
            )
        if self.attn == "state":
            return (self.num_layers, self.num_pages, self.kv_heads * self.head_dim)
        return (self.num_layers, self.num_pages, self.page_size, self.head_dim)

    def bytes_per_token_all_layers(self) -> int:
        return self.num_layers * self.components * self.token_bytes

    def pages_for(self, num_tokens: int) -> tuple[int, int]:
        """(first block, page count) a sequence of ``num_tokens`` holds in this entry and a room
        moves: every block of a full entry; the blocks its last ``window`` tokens reach in a
        sliding-window entry; one slot in a state entry."""
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        if self.attn == "state":
            return 0, 1
        blocks = -(-num_tokens // self.page_size)
        first = max(0, num_tokens - self.window) // self.page_size if self.window else 0
        return first, blocks - first

    # ---- addresses ---------------------------------------------------------------------------
    def slab_addr(self, layer: int, component: int) -> int:
        """Address of page 0 of (layer, component)."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} outside [0, {self.num_layers})")
        if not 0 <= component < self.components:
            raise IndexError(f"component {component} outside [0, {self.components})")
        return self.base_addr + (layer * self.components + component) * self.num_pages * (
            self.page_bytes
        )

    def page_addr(self, layer: int, component: int, page: int) -> int:
        if not 0 <= page < self.num_pages:
            raise IndexError(f"page {page} outside [0, {self.num_pages})")
        return self.slab_addr(layer, component) + page * self.page_bytes

    def signature(self) -> dict:
        """The fields both sides must agree on before any byte moves."""
        return {
            "role": self.role,
            "attn": self.attn,
            "dtype": self.dtype,
            "page_size": self.page_size,
            "num_layers": self.num_layers,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "kv_lora_rank": self.kv_lora_rank,
            "rope_dim": self.rope_dim,
            "head_start": self.head_start,
            "total_kv_heads": self.total_kv_heads or self.kv_heads,
            "scale_log2": list(self.scale_log2),
            "window": self.window,
            "segments": [list(x) for x in self.segments],
        }

    def with_pool(self, num_pages: int, base_addr: int) -> EntryLayout:
        return replace(self, num_pages=num_pages, base_addr=base_addr)


def state_runs(lay: EntryLayout, first: int, count: int) -> list[tuple[int, int]]:
    """(element offset, elements) inside one slot of state entry ``lay`` that hold its groups
    ``[first, first + count)`` (groups of this shard, 0-based), one run per sub-block, in slot
    order: what a head slice of a state gathers, and where it lands."""
    if lay.attn != "state":
        raise ValueError(f"entry {lay.role} is not a state entry")
    if not (0 <= first and count >= 1 and first + count <= lay.kv_heads):
        raise IndexError(f"groups [{first}, {first + count}) outside [0, {lay.kv_heads})")
    runs, base = [], 0
    for h, e in lay.segments:
        group = h * e
        runs.append((base + first * group, count * group))
        base += lay.kv_heads * group
    return runs


def page_runs(pages: list[int] | tuple[int, ...]) -> list[tuple[int, int]]:
    """Split a page list into maximal runs of consecutive ids: [(first_page, count), ...].

    Order is preserved: position i of the list maps to position i on the other side, so runs are
    cut wherever either side is not consecutive (see :func:`paired_runs`).
    """
    runs: list[tuple[int, int]] = []
    for p in pages:
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return runs


def paired_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """Runs where both source and destination pages are consecutive: [(src0, dst0, count)]."""
    if len(src) != len(dst):
        raise ValueError(
            f"page lists differ in length: {len(src)} source vs {len(dst)} destination"
        )
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if s0 + n == s and d0 + n == d:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


@dataclass(frozen=True)
class Transfer:
    """One contiguous copy: ``length`` bytes from local ``src`` to remote ``dst``."""

    src: int
    dst: int
    length: int


RANK_FIELDS = ("kv_heads", "head_start")  # a TP rank's head range: paired by shard_pieces


def check_compatible(local: EntryLayout, remote_signature: dict) -> str | None:
    """None when compatible, else a message naming the first differing field. A TP rank's head
    range (:data:`RANK_FIELDS`) is not compared: :func:`shard_pieces` pairs the ranks."""
    mine = local.signature()
    for key, value in mine.items():
        if key in RANK_FIELDS:
            continue
        theirs = remote_signature.get(key)
        if theirs != value:
            return f"entry {local.role}: {key} differs (local {value!r}, remote {theirs!r})"
    return None


def group_transfers(
    src: EntryLayout,
    dst: EntryLayout,
    src_pages: list[int],
    dst_pages: list[int],
    layers: range,
) -> list[Transfer]:
    """Copies that move ``src_pages`` of ``layers`` into ``dst_pages`` (paired by position).

    Consecutive pages on both sides coalesce into one copy per (layer, component).
    """
    err = check_compatible(src, dst.signature())
    if err:
        raise ValueError(err)
    runs = paired_runs(list(src_pages), list(dst_pages))
    pb = src.page_bytes
    out: list[Transfer] = []
    for layer in layers:
        for comp in range(src.components):
            s_base = src.slab_addr(layer, comp)
            d_base = dst.slab_addr(layer, comp)
            for s0, d0, n in runs:
                if s0 + n > src.num_pages or d0 + n > dst.num_pages:
                    raise IndexError(
                        f"page run ({s0}->{d0}, {n}) outside pools of"
                        f" {src.num_pages}/{dst.num_pages}"
                    )
                out.append(Transfer(s_base + s0 * pb, d_base + d0 * pb, n * pb))
    return out


def group_units(lay: EntryLayout, num_pages: int, layers: range) -> int:
    """Units (page rows) in the staged stream of a layer group over ``num_pages`` pages."""
    return len(layers) * lay.components * num_pages


def staging_rows(
    lay: EntryLayout, pages: list[int], layers: range, start: int, count: int
) -> list[int]:
    """Rows of ``lay``'s buffer that hold units ``[start, start + count)`` of the staged stream
    of ``layers`` over ``pages`` (see the module docstring); IndexError when out of bounds."""
    n, comps = len(pages), lay.components
    if not (0 <= layers.start < layers.stop <= lay.num_layers and layers.step == 1):
        raise IndexError(f"layers {layers} outside [0, {lay.num_layers})")
    if count < 1 or start < 0 or start + count > group_units(lay, n, layers):
        raise IndexError(f"units [{start}, {start + count}) outside the group's stream")
    bad = [p for p in pages if not 0 <= p < lay.num_pages]
    if bad:
        raise IndexError(f"pages {bad[:4]} outside [0, {lay.num_pages})")
    rows: list[int] = []
    u, end = start, start + count
    while u < end:  # one (layer, component) slab at a time
        slab = (layers.start + u // (comps * n)) * comps + (u // n) % comps
        a, b = u % n, min(n, u % n + end - u)
        base = slab * lay.num_pages
        rows.extend([base + p for p in pages[a:b]])
        u += b - a
    return rows


def mean_copy_bytes(lay: EntryLayout, src_pages: list[int], dst_pages: list[int]) -> float:
    """Average size of the direct copies :func:`group_transfers` would issue for these tables."""
    runs = paired_runs(list(src_pages), list(dst_pages))
    return len(src_pages) * lay.page_bytes / max(1, len(runs))


@dataclass
class PoolLayout:
    """All entries of one pool, keyed by role (``target``, optionally ``draft``)."""

    entries: dict[str, EntryLayout] = field(default_factory=dict)

    def add(self, entry: EntryLayout) -> None:
        if entry.role in self.entries:
            raise ValueError(f"pool already has a {entry.role} entry")
        self.entries[entry.role] = entry

    def signatures(self) -> dict[str, dict]:
        return {role: e.signature() for role, e in self.entries.items()}


@dataclass(frozen=True)
class ShardPiece:
    """Heads ``[head, head + heads)`` of entry ``role`` from prefill rank ``src`` (at head offset
    ``src_off`` of its shard) to decode rank ``dst`` (at head offset ``dst_off``)."""

    role: str
    src: int
    dst: int
    head: int
    heads: int
    src_off: int
    dst_off: int

    def whole(self, src: EntryLayout, dst: EntryLayout) -> bool:
        """Whole rows on both sides: direct copies of pages work (same shard on both ranks)."""
        return self.heads == src.kv_heads == dst.kv_heads

    def unit_bytes(self, lay: EntryLayout) -> int:
        """Bytes one (layer, component, page) unit of this piece carries."""
        return lay.page_size * self.heads * lay.head_dim * lay.elem_size


_SHARD_FIELDS = ("kv_heads", "head_start", "total_kv_heads")


def _same_entry(prefill: list[EntryLayout], decode: list[EntryLayout]) -> tuple[dict, int]:
    """The shards' common signature (but the head range) and head count; ValueError if any
    shard differs."""
    if not prefill or not decode:
        raise ValueError("every side needs at least one rank")
    ref = {k: v for k, v in prefill[0].signature().items() if k not in _SHARD_FIELDS}
    total = prefill[0].signature()["total_kv_heads"]
    for side, shards in (("prefill", prefill), ("decode", decode)):
        for rank, lay in enumerate(shards):
            sig, where = lay.signature(), f"{side} rank {rank}"
            for k, v in ref.items():
                if sig[k] != v:
                    raise ValueError(
                        f"entry {ref['role']}: {k} differs ({where}: {sig[k]!r},"
                        f" prefill rank 0: {v!r})"
                    )
            if sig["total_kv_heads"] != total:
                raise ValueError(
                    f"entry {ref['role']}: {where} has {sig['total_kv_heads']}"
                    f" KV heads in all, prefill rank 0 {total}"
                )
    return ref, total


def shard_pieces(prefill: list[EntryLayout], decode: list[EntryLayout]) -> list[ShardPiece]:
    """Which prefill rank sends which heads of one entry to which decode rank (rank order in
    both lists). ValueError, naming what differs, when the shards cannot be paired: another
    layout field, another head count, or a head a decode rank holds that no prefill rank has."""
    ref, total = _same_entry(prefill, decode)
    if ref["attn"] == "mla":  # the latent, whole on every rank: once per decode rank, from rank 0
        return [ShardPiece(ref["role"], 0, d, 0, 1, 0, 0) for d in range(len(decode))]
    out: list[ShardPiece] = []
    for d, dl in enumerate(decode):
        for h in range(dl.head_start, dl.head_start + dl.kv_heads):
            src = next(
                (
                    r
                    for r, pl in enumerate(prefill)
                    if pl.head_start <= h < pl.head_start + pl.kv_heads
                ),
                None,
            )
            if src is None:
                raise ValueError(
                    f"entry {ref['role']}: KV head {h} of decode rank {d} is held"
                    " by no prefill rank"
                )
            last = out[-1] if out else None
            if last and last.dst == d and last.src == src and last.head + last.heads == h:
                out[-1] = replace(last, heads=last.heads + 1)
            else:
                out.append(
                    ShardPiece(
                        ref["role"], src, d, h, 1, h - prefill[src].head_start, h - dl.head_start
                    )
                )
    held = {h for dl in decode for h in range(dl.head_start, dl.head_start + dl.kv_heads)}
    if held != set(range(total)):
        raise ValueError(
            f"entry {ref['role']}: decode ranks hold KV heads {sorted(held)}, not all {total}"
        )
    return out
