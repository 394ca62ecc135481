"""Prefill's checks of decode's Register: nothing a hostile or broken peer sends may make this
sender write outside the pages that peer really holds, or hurt another peer's rooms.

A Register is accepted only when, for every entry:

* the entry exists here and its layout signature matches (same checks as the handshake);
* decode's pool is well formed (``num_pages >= 1``, ``base_addr`` set) and every page id is in
  ``[0, num_pages)``, with no repeats;
* it lists exactly the pages the prompt needs (``EntryLayout.pages_for(num_tokens)``: every
  block, the blocks the last window reaches, or one state slot), and ``num_tokens`` is the
  prompt length this prefill expects for the room;

and for the peer (:class:`PeerBook`):

* the Mooncake session it names is on the host the Register came from (zmq ``Peer-Address``),
  so a peer cannot point this sender's writes at another host;
* the connection proved it owns that session (:mod:`kvtransfer.link.proof`) before any of its
  registrations is served; a session then belongs to that one connection, and keeps the pool
  addresses (per entry) its first Register declared: another connection naming the same
  session is refused.
  A tensor-parallel decode's other ranks (``Register.ranks``) are held to the same rules: each
  rank's session on the registering host, proven, and the same in every later Register;
* the ranks on both sides cover every KV head of every entry exactly (:func:`check_ranks`).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field, replace

from ..memory.layout import EntryLayout, check_compatible, shard_pieces
from ..protocol import messages as m

MAX_STAGING_SLOTS = 1024
MAX_SLOT_BYTES = 1 << 30
STAGING = "staging"  # PeerBook.pools key of decode's staging region


class RegistrationError(ValueError):
    """The Register cannot be served; the message names the first problem."""


def check_entries(
    reg: m.Register,
    layouts: dict[str, EntryLayout],
    num_tokens: int | None = None,
    required: list[str] | None = None,
) -> dict[str, EntryLayout]:
    """decode's layout of every entry (with its pool address), or RegistrationError.
    ``required``: the entries the room has pages in (None: not checked yet)."""
    if num_tokens is not None and reg.num_tokens != num_tokens:
        raise RegistrationError(f"num_tokens {reg.num_tokens} but the prompt has {num_tokens}")
    if reg.num_tokens < 1:
        raise RegistrationError(f"num_tokens must be >= 1, got {reg.num_tokens}")
    if reg.staging_slots and not (
        0 < reg.staging_slots <= MAX_STAGING_SLOTS
        and 0 < reg.staging_slot_bytes <= MAX_SLOT_BYTES
        and reg.staging_addr > 0
    ):
        raise RegistrationError(
            f"bad staging region: {reg.staging_slots} slots of {reg.staging_slot_bytes} B"
            f" at {reg.staging_addr:#x}"
        )
    dst: dict[str, EntryLayout] = {}
    for entry in reg.entries:
        local = layouts.get(entry.role)
        if local is None:
            raise RegistrationError(
                f"incompatible layout: decode registered entry {entry.role!r} that prefill does"
                " not have"
            )
        if entry.role in dst:
            raise RegistrationError(f"entry {entry.role!r} registered twice")
        err = check_compatible(local, entry.signature)
        if err:
            raise RegistrationError(f"incompatible layout: {err}")
        try:
            lay = EntryLayout(
                **entry.signature, num_pages=entry.num_pages, base_addr=entry.base_addr
            )
        except (TypeError, ValueError) as e:
            raise RegistrationError(f"entry {entry.role}: bad layout ({e})") from None
        if entry.base_addr <= 0:
            raise RegistrationError(f"entry {entry.role}: no pool address")
        _check_pages(entry, lay, reg.num_tokens)
        dst[entry.role] = lay
    missing = [role for role in required or () if role not in dst]
    if missing:
        raise RegistrationError(
            f"incompatible layout: decode did not register entry {missing[0]!r}"
        )
    return dst


def check_ranks(
    reg: m.Register, dst: dict[str, EntryLayout], prefill: dict[str, dict[int, EntryLayout]]
) -> dict[str, list]:
    """Which prefill rank sends which heads to which decode rank, per entry of ``dst``
    (:func:`~kvtransfer.memory.layout.shard_pieces`; ``prefill``: role -> {rank: its shard}, rank 0
    first), or RegistrationError: the ranks holding an entry on each side must cover every KV
    head of it exactly, and decode ranks past rank 0 need staging regions. A rank holds the
    entries it names (a TP draft's ranks may be other processes than the target's); pieces
    carry the ranks' numbers on each side (0 = the Register's own)."""
    for k, rank in enumerate(reg.ranks, 1):
        if not (
            0 < rank.staging_slots <= MAX_STAGING_SLOTS
            and 0 < rank.staging_slot_bytes <= MAX_SLOT_BYTES
            and rank.staging_addr > 0
        ):
            raise RegistrationError(f"decode rank {k}: no staging region")
        if not rank.heads or set(rank.heads) - set(dst):
            raise RegistrationError(
                f"decode rank {k}: head ranges for {sorted(rank.heads)}, entries {sorted(dst)}"
            )
        for role, pool in rank.pools.items():
            pages = next((e.pages for e in reg.entries if e.role == role), None)
            if (
                role not in rank.heads
                or len(pool) != 2
                or pool[0] <= 0
                or pages is None
                or any(not 0 <= x < pool[1] for x in pages)
            ):
                raise RegistrationError(f"decode rank {k}: bad pool of entry {role}")
    pieces = {}
    for role, lay in dst.items():
        ranks, numbers = [lay], [0]
        for k, rank in enumerate(reg.ranks, 1):
            if role not in rank.heads:
                continue
            first, count = (list(rank.heads[role]) + [None, None])[:2]
            try:
                ranks.append(replace(lay, head_start=first, kv_heads=count, base_addr=0))
            except (TypeError, ValueError) as e:
                raise RegistrationError(f"decode rank {k}: entry {role}: {e}") from None
            numbers.append(k)
        src = list(prefill[role].items())
        try:
            found = shard_pieces([x for _, x in src], ranks)
        except ValueError as e:
            raise RegistrationError(f"incompatible tensor parallelism: {e}") from None
        pieces[role] = [replace(p, src=src[p.src][0], dst=numbers[p.dst]) for p in found]
    return pieces


def check_slots(reg: m.Register, dst: dict[str, EntryLayout], pieces: dict) -> None:
    """RegistrationError unless each piece's page fits one slot of its decode rank."""
    for role, found in pieces.items():
        for p in found:
            slot = dest(reg, p.dst)[3]
            unit = p.unit_bytes(dst[role])
            if unit > slot:
                raise RegistrationError(
                    f"decode rank {p.dst}: a staging slot of {slot} B holds"
                    f" no page of entry {role} ({unit} B)"
                )


def _check_pages(entry: m.EntrySpec, lay: EntryLayout, num_tokens: int) -> None:
    first, n = lay.pages_for(num_tokens)
    # decode may hold (cache) only whole blocks of the prompt, and never a state
    last = first if lay.attn == "state" else min(first + n, num_tokens // lay.page_size)
    if not first <= entry.first <= max(first, last):
        raise RegistrationError(
            f"entry {entry.role}: first block {entry.first} outside [{first}, {max(first, last)}]"
        )
    need = first + n - entry.first
    if len(entry.pages) != need:
        raise RegistrationError(
            f"entry {entry.role}: {len(entry.pages)} pages from block {entry.first} for"
            f" {num_tokens} tokens (need {need})"
        )
    bad = [p for p in entry.pages if not 0 <= p < entry.num_pages]
    if bad:
        raise RegistrationError(
            f"entry {entry.role}: page ids {bad[:4]} outside [0, {entry.num_pages})"
        )
    if len(set(entry.pages)) != len(entry.pages):
        raise RegistrationError(f"entry {entry.role}: repeated page ids")


def session_host(session_id: str) -> str:
    host, sep, port = session_id.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RegistrationError(f"session {session_id!r} is not host:port")
    return host.strip("[]")


@dataclass
class Peer:
    session: str | None = None  # the session this connection proved it owns
    pools: dict[str, tuple[int, int]] = field(default_factory=dict)  # role -> (base, num_pages)
    pending: int = 0  # unclaimed registrations
    held: list[m.Register] = field(default_factory=list)  # waiting for the session proof
    proving: bool = False
    refused: str = ""  # the proof failed: every registration of this connection is refused
    ranks: tuple | None = None  # decode ranks 1..N-1: (session, staging region) each
    proofs_left: int = 0  # session proofs still under way


class PeerBook:
    """What each decode connection (zmq identity) proved and declared: session, pool addresses."""

    def __init__(self, max_pending_per_peer: int):
        self.max_pending = max_pending_per_peer
        self._peers: dict[bytes, Peer] = {}
        self._owner: dict[str, bytes] = {}  # session -> the identity that proved it

    def peer(self, ident: bytes) -> Peer:
        return self._peers.setdefault(ident, Peer())

    def known(self, ident: bytes) -> Peer | None:
        return self._peers.get(ident)

    def items(self):
        """(connection identity, peer) pairs."""
        return self._peers.items()

    def check(self, ident: bytes, peer_address: str | None, reg: m.Register) -> None:
        """RegistrationError unless ``reg`` is consistent with what ``ident`` proved before."""
        for session in sessions(reg):
            host = session_host(session)
            if peer_address and _is_ip(host) and ipaddress.ip_address(host) != _ip(peer_address):
                raise RegistrationError(
                    f"session {session} is not on the registering host {peer_address}"
                )
            owner = self._owner.get(session)
            if owner is not None and owner != ident:
                raise RegistrationError(f"session {session} belongs to another connection")
        peer = self.peer(ident)
        if peer.ranks is not None and peer.ranks != _ranks(reg):
            raise RegistrationError("decode ranks (sessions or staging regions) changed")
        if peer.session not in (None, reg.session_id):
            raise RegistrationError(f"this connection proved session {peer.session}, not this one")
        for e in reg.entries:
            known = peer.pools.get(e.role)
            if known is not None and known != (e.base_addr, e.num_pages):
                raise RegistrationError(f"entry {e.role}: pool address or size changed")
        known = peer.pools.get(STAGING)
        if known is not None and known != _staging(reg):
            raise RegistrationError("staging region changed")

    def bind(self, ident: bytes, reg: m.Register) -> None:
        """``ident`` proved it owns ``reg``'s session: it is that connection's from now on."""
        peer = self.peer(ident)
        peer.session = reg.session_id
        for session in sessions(reg):
            self._owner[session] = ident
        peer.ranks = _ranks(reg)
        for e in reg.entries:
            peer.pools.setdefault(e.role, (e.base_addr, e.num_pages))
        peer.pools.setdefault(STAGING, _staging(reg))

    def add_pending(self, ident: bytes) -> bool:
        """Count one unclaimed registration of ``ident``; False when it is over its cap."""
        peer = self.peer(ident)
        if peer.pending >= self.max_pending:
            return False
        peer.pending += 1
        return True

    def remove_pending(self, ident: bytes) -> None:
        peer = self._peers.get(ident)
        if peer is not None and peer.pending > 0:
            peer.pending -= 1


def sessions(reg: m.Register) -> list[str]:
    """Every Mooncake session ``reg`` names: decode rank 0's, then its other ranks'."""
    return [reg.session_id] + [r.session_id for r in reg.ranks]


def proofs(reg: m.Register) -> list[tuple[str, int, bytes]]:
    """(session, proof address, token) of every decode rank."""
    return [(reg.session_id, reg.proof_addr, reg.proof)] + [
        (r.session_id, r.proof_addr, r.proof) for r in reg.ranks
    ]


def _ranks(reg: m.Register) -> tuple:
    return tuple(
        (*dest(reg, k), sorted((role, tuple(v)) for role, v in r.pools.items()))
        for k, r in enumerate(reg.ranks, 1)
    )


def dest(reg: m.Register, rank: int) -> tuple[str, int, int, int]:
    """(session, staging address, slots, slot bytes) of decode rank ``rank`` (0: the
    Register's own)."""
    if rank == 0:
        return reg.session_id, reg.staging_addr, reg.staging_slots, reg.staging_slot_bytes
    d = reg.ranks[rank - 1]
    return d.session_id, d.staging_addr, d.staging_slots, d.staging_slot_bytes


def _staging(reg: m.Register) -> tuple[int, int, int]:
    return (reg.staging_addr, reg.staging_slots, reg.staging_slot_bytes)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _ip(addr: str):
    try:
        ip = ipaddress.ip_address(addr.strip("[]"))
    except ValueError:
        return None
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1 on a dual-stack socket
    return mapped or ip
