"""Deployment identity: what a prefill and a decode must share before any byte moves.

A :class:`Fingerprint` is the protocol version, a key id derived from the shared secret (never
the secret: ``HMAC-SHA256(secret, "pd-key-id")``, first 8 bytes in hex), the model's identity
(a digest of its checkpoint files, computed by the stage), the draft's, and the KV dtype and page
size. Decode sends its fingerprint in every ``Register`` (and a decode server's router in every
forwarded request); prefill compares it with its own and refuses at once, naming the first field
that differs (:func:`mismatch`): ``secret differs``, ``model differs: prefill serves X, decode
serves Y``, ``protocol 5 vs 4``. Every such error starts with :data:`INCOMPATIBLE`, so a caller
can tell a refusal that will repeat on every request (mark that server incompatible) from a
transient one.
"""

from __future__ import annotations

import hashlib
import hmac

import msgspec

INCOMPATIBLE = "incompatible deployment"
NO_KEY = "none"  # key id of a side without a shared secret
# the order fields are compared in: the first difference names the refusal
REASONS = ("protocol", "secret", "model", "draft", "kv")


class Fingerprint(msgspec.Struct, frozen=True):
    """One side's deployment identity (every field is safe to show to anyone who asks)."""

    protocol: int
    key_id: str
    model: str  # digest of the checkpoint (config + weights)
    model_name: str = ""  # the checkpoint's directory name, for people
    draft: str = ""  # "" speculative decoding off, "self:N" self-draft, "model <digest>", or
    # "eagle v1 (feature F, draft vocab N) <digest>" (backends/stages/fingerprint.py)
    kv: str = ""  # KV dtype and page size, e.g. "float32/page16"


class Identity(msgspec.Struct, frozen=True):
    """The model part of a fingerprint, which only the stage knows (kvtransfer adds the rest)."""

    model: str
    model_name: str = ""
    draft: str = ""
    kv: str = ""


def key_id(secret: bytes | str | None) -> str:
    if not secret:
        return NO_KEY
    if isinstance(secret, str):
        secret = secret.encode()
    return hmac.new(secret, b"pd-key-id", hashlib.sha256).hexdigest()[:16]


def fingerprint(identity: Identity, secret: bytes | str | None, protocol: int) -> Fingerprint:
    return Fingerprint(
        protocol, key_id(secret), identity.model, identity.model_name, identity.draft, identity.kv
    )


def mismatch(prefill: Fingerprint, decode: Fingerprint) -> tuple[str, str] | None:
    """(reason, message) for the first field that differs, else None. ``reason`` is one of
    :data:`REASONS` (a metric label); the message names both values."""
    if prefill.protocol != decode.protocol:
        return "protocol", f"protocol {prefill.protocol} vs {decode.protocol} (prefill vs decode)"
    if prefill.key_id != decode.key_id:
        return "secret", (
            f"secret differs (prefill key id {prefill.key_id}, decode key id {decode.key_id}):"
            " give every server the same --secret-file"
        )
    if prefill.model != decode.model:
        return "model", (
            f"model differs: prefill serves {_name(prefill)}, decode serves {_name(decode)}"
        )
    if prefill.draft != decode.draft:
        a, b = prefill.draft or "none", decode.draft or "none"
        return "draft", f"draft model differs: prefill {a}, decode {b}"
    if prefill.kv != decode.kv:
        return "kv", f"KV layout differs: prefill {prefill.kv}, decode {decode.kv}"
    return None


def refusal(prefill: Fingerprint, decode: Fingerprint) -> tuple[str, str] | None:
    """:func:`mismatch` with the message prefixed by :data:`INCOMPATIBLE`."""
    got = mismatch(prefill, decode)
    return None if got is None else (got[0], f"{INCOMPATIBLE}: {got[1]}")


def reason_of(message: str) -> str:
    """The :data:`REASONS` label of an incompatibility message (``other`` if none fits)."""
    for reason, needle in (  # a table: (label, the words its message starts with)
        ("protocol", "protocol "), ("secret", "secret differs"), ("model", "model differs"),
        ("draft", "draft model differs"), ("kv", "KV layout differs"),
    ):  # fmt: skip
        if f"{INCOMPATIBLE}: {needle}" in message:
            return reason
    return "other"


def _name(fp: Fingerprint) -> str:
    return f"{fp.model_name or 'model'} ({fp.model[:12]})"
