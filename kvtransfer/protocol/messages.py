"""Control-plane wire messages: typed msgspec structs in a versioned, signed envelope.

Every ZMQ frame is one msgpack ``Envelope``: ``{v: PROTOCOL_VERSION, t: send time, p: payload,
mac: hmac|None}`` where ``payload`` is the msgpack of one message of the tagged union
:data:`Message`. With a shared secret, ``mac`` is HMAC-SHA256(secret, v | t | payload), checked
with ``hmac.compare_digest``; a :class:`Verifier` also drops frames older than its window (a
replay of a captured message) and exact repeats of a frame it already accepted. No
Python-object serialization, no positional frames. Every control message of the product is
here, the client-cancel side channel (postprocess -> decode) included.

Version history:
  1 — Register / Ack / Complete / Fail / Abort / Ping / Pong; per-entry layout signatures.
  2 — Cancel (client cancel, postprocess -> decode) joins the union; the separate packed cancel
      frame format of version 1 deployments is gone.
  3 — the envelope carries its send time ``t``, covered by the MAC with the version, so a signed
      frame cannot be replayed outside the window or moved to another protocol version;
      Register lists exactly the prompt's pages of each entry and carries a proof that its
      sender owns the Mooncake session it names (``proof`` / ``proof_addr``).
  4 — staged transfers for fragmented page tables: Register declares decode's staging region
      (``staging_addr`` / ``staging_slots`` / ``staging_slot_bytes``, none: 0); Want (prefill
      asks for slots for a room), Grant (decode lends one slot to that room), Staged (a chunk
      landed in a granted slot; decode scatters it into the room's own pages); FirstToken
      (prefill sends the room's first token as soon as it is sampled, before the KV landed).
  5 — deployment identity at first contact: Register carries decode's ``Fingerprint``
      (protocol, key id of the secret, model / draft digests, KV dtype and page size) and
      prefill refuses a different one at once (signed ``Fail`` "incompatible deployment: ...");
      ``Refuse``: prefill's UNSIGNED answer to a Register it cannot verify (another secret) or
      read (another protocol version), which decode takes as a hint only (see
      :func:`peek_refusal`). Its shape and tag are frozen across versions. Complete carries
      ``checksums`` (entry -> CRC32C per layer) when ``kv_checksum`` is on (checksum.py).
  6 — tensor parallelism: Register lists decode's ranks 1..N-1 (``ranks``: each rank's session,
      proof, staging region and KV head range per entry; rank 0 is the Register itself, its
      head range in each entry's signature); Want and Grant name the decode rank whose slots
      they are about; Staged names that rank and the head range (``head_off``, ``heads``) of
      its shard the chunk carries (0 heads: whole rows); a rank's ``pools`` take direct copies
      of whole shards (same TP on both sides).
  7 — fp8 KV: each entry's layout signature carries ``scale_log2`` (the exponent of every
      (layer, component)'s power-of-two scale; empty for unscaled dtypes), so a prefill and a
      decode whose fp8 scales differ refuse the room like any other layout mismatch.
  8 — EAGLE heads: Complete's ``extra`` carries ``draft_feature`` (the target's feature at the
      last prompt position, float32) for a head's first draft; the fingerprint's ``draft`` names
      a head's kind, feature and draft vocabulary before its digest (``eagle v1 (feature
      final_norm, draft vocab N) <digest>``; a draft model: ``model <digest>``).
  9 — hybrid models: an entry is a model's layers of one kind (roles ``target``,
      ``target.window``, ``target.state``, and the same for ``draft``); a layout signature
      names its ``window`` (a sliding-window entry: a room registers and moves only the pages
      its last window reaches) and its ``segments`` (a state entry: the slot's sub-blocks; a
      room registers one slot); an entry of a Register names the ``first`` block it lists
      pages from (decode's prefix cache holds the blocks before it: prefill sends only the
      rest; a full hit moves no KV byte).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import time
from collections import OrderedDict

import msgspec

from .identity import Fingerprint

PROTOCOL_VERSION = 9

Scalar = int | float | str
# a layout signature's field (EntryLayout.signature): segments are a list of [heads, elems]
SigValue = int | str | list[int | list[int]]
ExtraValue = int | float | str | list[Scalar]


class EntrySpec(msgspec.Struct, frozen=True):
    """Decode's destination for one pool entry: layout signature + where its pages live."""

    role: str
    signature: dict[str, SigValue]
    pages: list[int]  # destination page ids, position i receives prefill's i-th page
    base_addr: int  # decode's buffer address of this entry
    num_pages: int  # pages in decode's pool for this entry
    # the block of the prompt ``pages[0]`` holds: blocks before it decode already has (its prefix
    # cache) or never holds (before a sliding window); prefill sends blocks [first, ...) only
    first: int = 0


class RankDest(msgspec.Struct, frozen=True):
    """One more decode rank of a tensor-parallel decode: its own Mooncake session (with its
    proof), its staging region, and the KV heads ``[first, first + count]`` of each entry's
    total it holds (role -> [first, count]; an MLA entry: [0, 1], the whole latent)."""

    session_id: str
    proof_addr: int
    proof: bytes
    staging_addr: int
    staging_slots: int
    staging_slot_bytes: int
    heads: dict[str, list[int]]
    # role -> [pool address, pages] of this rank's shard: direct copies (same TP, long runs)
    pools: dict[str, list[int]] = {}


class Register(msgspec.Struct, tag="register", frozen=True):
    """decode -> prefill: "room R's KV goes to these pages of engine session S"."""

    room: int
    session_id: str  # decode's Mooncake session "host:rpc_port"
    entries: list[EntrySpec]
    num_tokens: int
    # proof that the sender owns session S: ``proof`` is also in S's memory at ``proof_addr``,
    # where prefill reads it (once per connection) before it writes anything there
    proof_addr: int = 0
    proof: bytes = b""
    # decode's registered staging region (slots of slot_bytes each); 0 slots: direct writes only
    staging_addr: int = 0
    staging_slots: int = 0
    staging_slot_bytes: int = 0
    # decode's deployment identity (protocol/identity.py); prefill refuses a different one
    fingerprint: Fingerprint | None = None
    # decode ranks 1..N-1 of a tensor-parallel decode (rank 0 is this Register's own fields)
    ranks: list[RankDest] = []


class Ack(msgspec.Struct, tag="ack", frozen=True):
    """prefill -> decode: this prefill instance claims the room; carries its layouts."""

    room: int
    signatures: dict[str, dict[str, SigValue]] = {}


class Complete(msgspec.Struct, tag="complete", frozen=True):
    """prefill -> decode: every KV write of the room landed; aux data attached."""

    room: int
    first_token: int
    extra: dict[str, ExtraValue] = {}
    checksums: dict[str, list[int]] = {}  # entry -> CRC32C per layer (kv_checksum)


class Fail(msgspec.Struct, tag="fail", frozen=True):
    """prefill -> decode: the room failed on prefill's side."""

    room: int
    reason: str


class Abort(msgspec.Struct, tag="abort", frozen=True):
    """decode -> prefill: give the room up (client cancel, decode-side timeout)."""

    room: int
    reason: str


class Ping(msgspec.Struct, tag="ping", frozen=True):
    seq: int


class Pong(msgspec.Struct, tag="pong", frozen=True):
    seq: int


class Cancel(msgspec.Struct, tag="cancel", frozen=True):
    """postprocess -> decode: the client cancelled the request of this room."""

    room: int


class Want(msgspec.Struct, tag="want", frozen=True):
    """prefill -> decode: room R has chunks to stage; lend it up to ``slots`` staging slots."""

    room: int
    slots: int
    rank: int = 0  # the decode rank whose slots are wanted


class Grant(msgspec.Struct, tag="grant", frozen=True):
    """decode -> prefill: staging slot ``slot`` belongs to room R until R ends; write one chunk
    into it (again after every Staged, once this Grant comes back)."""

    room: int
    slot: int
    rank: int = 0  # the decode rank the slot is on


class Staged(msgspec.Struct, tag="staged", frozen=True):
    """prefill -> decode: units [start, start + count) of the staged stream of entry ``role``,
    layers [layer_start, layer_stop), landed in slot ``slot`` (see kvtransfer/memory/layout.py)."""

    room: int
    slot: int
    role: str
    layer_start: int
    layer_stop: int
    start: int
    count: int
    rank: int = 0  # the decode rank whose slot it landed in
    head_off: int = 0  # heads [head_off, head_off + heads) of that rank's shard; 0 heads: all
    heads: int = 0


class FirstToken(msgspec.Struct, tag="first_token", frozen=True):
    """prefill -> decode: the room's first token, sampled; its KV may still be in flight
    (Complete repeats it and is what lets decode run the room)."""

    room: int
    token: int


class Refuse(msgspec.Struct, tag="refuse", frozen=True):
    """prefill -> decode, UNSIGNED: "I cannot take room R's Register": another secret (the MAC
    did not verify) or another protocol version. Carries only prefill's key id, protocol and the
    reason; decode treats it as a hint (it can fail the unclaimed room early, never change data).
    Frozen across protocol versions: any version reads it (:func:`peek_refusal`)."""

    room: int
    reason: str
    key_id: str = ""
    protocol: int = 0


class _RoomOf(msgspec.Struct, tag="register"):
    """Any version's Register, read only for its room (to answer it with a Refuse)."""

    room: int


# one union of every message kind, kept as a paragraph (formatted, it is a line per kind)
Message = (
    Register | Ack | Complete | Fail | Abort | Ping | Pong | Cancel | Want | Grant | Staged
    | FirstToken | Refuse
)  # fmt: skip


class Envelope(msgspec.Struct, frozen=True):
    v: int
    t: float  # sender's wall-clock time (s)
    p: bytes
    mac: bytes | None = None


class MessageError(ValueError):
    """A frame that must be dropped; ``kind``: garbage / version / auth / stale / replay."""

    KINDS = ("garbage", "version", "auth", "stale", "replay")

    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


_env_enc = msgspec.msgpack.Encoder()
_env_dec = msgspec.msgpack.Decoder(Envelope)
_msg_dec = msgspec.msgpack.Decoder(Message)
_any_env_dec = msgspec.msgpack.Decoder(Envelope)
_refuse_dec = msgspec.msgpack.Decoder(Refuse)
_room_of_dec = msgspec.msgpack.Decoder(_RoomOf)


def count_drop(counts: dict[str, int], kind: str) -> bool:
    """Count one dropped frame of ``kind`` in ``counts``; True when it deserves a log line (the
    first five of each kind, then at powers of two, so a flood cannot flood the log)."""
    n = counts[kind] = counts.get(kind, 0) + 1
    return n <= 5 or n & (n - 1) == 0


def _mac(secret: bytes, version: int, t: float, payload: bytes) -> bytes:
    return hmac.new(secret, struct.pack(">Hd", version, t) + payload, hashlib.sha256).digest()


def encode_unsigned(msg: Message, now: float | None = None) -> bytes:
    """A frame without a MAC (only a :class:`Refuse` is ever sent that way)."""
    return encode(msg, None, now)


def peek_refusal(frame: bytes) -> Refuse | None:
    """The :class:`Refuse` in a frame that did not verify (unsigned, or another version), else
    None. Untrusted: the caller may only use it to fail a room early."""
    try:
        return _refuse_dec.decode(_any_env_dec.decode(frame).p)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def peek_register(frame: bytes) -> tuple[int, int] | None:
    """(envelope version, room) of a Register frame of any protocol version, read WITHOUT its
    MAC being checked (to answer it with a Refuse), else None."""
    try:
        env = _any_env_dec.decode(frame)
        return env.v, _room_of_dec.decode(env.p).room
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def encode(msg: Message, secret: bytes | None = None, now: float | None = None) -> bytes:
    payload = _env_enc.encode(msg)
    t = time.time() if now is None else now
    mac = _mac(secret, PROTOCOL_VERSION, t, payload) if secret else None
    return _env_enc.encode(Envelope(PROTOCOL_VERSION, t, payload, mac))


def _open(frame: bytes, secret: bytes | None) -> Envelope:
    try:
        env = _env_dec.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise MessageError("garbage", f"not an envelope ({e})") from None
    if env.v != PROTOCOL_VERSION:
        raise MessageError(
            "version", f"protocol version {env.v} (this side speaks {PROTOCOL_VERSION})"
        )
    if secret:
        if env.mac is None:
            raise MessageError("auth", "message is not signed but a shared secret is configured")
        if not hmac.compare_digest(env.mac, _mac(secret, env.v, env.t, env.p)):
            raise MessageError("auth", "bad HMAC")
    return env


def _payload(env: Envelope) -> Message:
    try:
        return _msg_dec.decode(env.p)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise MessageError("garbage", f"bad payload ({e})") from None


def decode(frame: bytes, secret: bytes | None = None) -> Message:
    """Decode one frame or raise :class:`MessageError` (stateless: no replay check)."""
    return _payload(_open(frame, secret))


class Verifier:
    """Decodes frames for one receiver: signature, then (with a secret) freshness: a frame sent
    more than ``max_age_s`` ago or ahead (clock skew included), or a frame it accepted before
    (same MAC), is dropped. Not thread-safe: one per receiving thread."""

    def __init__(self, secret: bytes | None, max_age_s: float = 120.0, remember: int = 65536):
        self.secret, self.max_age_s, self.remember = secret, max_age_s, remember
        self._seen: OrderedDict[bytes, float] = OrderedDict()

    def decode(self, frame: bytes, now: float | None = None) -> Message:
        env = _open(frame, self.secret)
        if self.secret and self.max_age_s:
            now = time.time() if now is None else now
            if abs(now - env.t) > self.max_age_s:
                raise MessageError(
                    "stale", f"sent {now - env.t:+.1f}s ago (window {self.max_age_s:g}s)"
                )
            if env.mac in self._seen:
                raise MessageError("replay", "a frame that was already accepted")
            msg = _payload(env)
            self._seen[env.mac] = env.t
            while len(self._seen) > self.remember or (
                self._seen and now - next(iter(self._seen.values())) > self.max_age_s
            ):
                self._seen.popitem(last=False)
            return msg
        return _payload(env)
