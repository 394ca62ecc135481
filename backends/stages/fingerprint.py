"""A stage's deployment identity (kvtransfer/protocol/identity.py) from its parameters.

The model's identity is a digest of its checkpoint: ``config.json`` and every weight file
(``*.safetensors``, ``*.bin``, ``*.gguf``), names and contents, BLAKE2b. Hashing is done once per
process and file version (path, size, mtime): SmolLM2-135M's 517 MB took 0.5 s here. Two copies
of the same checkpoint in different directories have the same digest; a fine-tune of the same
architecture (same config, other weights) has another.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading

import msgspec

from kvtransfer import INCOMPATIBLE, PROTOCOL_VERSION, Fingerprint, Identity, fingerprint, refusal

from .errors import Incompatible
from .params import StageParams

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")
_cache: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> file digest
_lock = threading.Lock()


def file_digest(path: str) -> str:
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    with _lock:
        got = _cache.get(key)
    if got is None:
        h = hashlib.blake2b(digest_size=16)
        with open(path, "rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
        got = h.hexdigest()
        with _lock:
            _cache[key] = got
    return got


def checkpoint_digest(path: str) -> str:
    """Digest of a checkpoint directory's config and weights (a single file: of that file)."""
    if os.path.isfile(path):
        return file_digest(path)
    names = sorted(n for n in os.listdir(path) if n == "config.json" or n.endswith(WEIGHT_SUFFIXES))
    if not names:
        raise ValueError(f"{path}: no config.json or weight files to identify the model by")
    h = hashlib.blake2b(digest_size=16)
    for n in names:
        h.update(f"{n}\0{file_digest(os.path.join(path, n))}\0".encode())
    return h.hexdigest()


def draft_identity(path: str) -> str:
    """A draft checkpoint's part of the fingerprint: its digest; for an EAGLE head also what
    speculation it configures (kind, feature, draft vocabulary), so a refusal names it."""
    from ..runtime.eagle import head_config

    head = head_config(path)
    digest = checkpoint_digest(path)
    if head is None:
        return f"model {digest}"
    return (
        f"eagle v{head.get('version')} (feature {head.get('feature')}, draft vocab"
        f" {head.get('draft_vocab_size')}) {digest}"
    )


def stage_identity(p: StageParams) -> Identity:
    """Model, draft and KV identity of the deployment these parameters describe."""
    draft = ""
    if p.spec_enabled:
        draft = draft_identity(p.draft_path) if p.draft_path else f"self:{p.draft_layers}"
    name = os.path.basename(os.path.normpath(p.model_path))
    kv_dtype = p.dtype if p.kv_cache_dtype == "auto" else p.kv_cache_dtype
    kv = f"{kv_dtype}/page{p.page_size}" + ("/crc32c" if p.kv_checksum else "")
    return Identity(checkpoint_digest(p.model_path), name, draft, kv)


def deployment_identity(p: StageParams) -> Identity | None:
    """:func:`stage_identity`, computed once per process and checkpoint; None when the
    checkpoint cannot be read (its load fails with the real error)."""
    try:
        return stage_identity(p)
    except (OSError, ValueError):
        return None


def stage_fingerprint(p: StageParams) -> Fingerprint | None:
    """The full fingerprint (protocol, key id of the secret in effect, identity); None when the
    checkpoint cannot be read (then nothing is checked against it)."""
    ident = deployment_identity(p)
    return None if ident is None else fingerprint(ident, p.secret or None, PROTOCOL_VERSION)


# ---- first contact over Triton gRPC: the router's forwarded request carries its fingerprint --
PARAM = "pd_fingerprint"  # request parameter (a JSON string) of a forwarded request


def to_param(fp: Fingerprint | None) -> str:
    return "" if fp is None else msgspec.json.encode(fp).decode()


def info_labels(fp: Fingerprint) -> dict[str, str]:
    """The fingerprint as metric labels (``pd_deployment_info``; nothing in it is secret)."""
    return {f: str(getattr(fp, f)) for f in fp.__struct_fields__}


def from_labels(labels: dict[str, str]) -> Fingerprint | None:
    fields = {f: labels[f] for f in Fingerprint.__struct_fields__ if f in labels}
    try:
        return Fingerprint(**{**fields, "protocol": int(fields["protocol"])})
    except (KeyError, TypeError, ValueError):
        return None


class ForwardCheck:
    """Prefill's check of a forwarded request's fingerprint, with refusals counted by reason."""

    def __init__(self, mine: Fingerprint | None):
        self.mine = mine
        self.refusals: dict[str, int] = {}
        self._lock = threading.Lock()

    def check(self, params_json: str | None) -> None:
        """Raise :class:`Incompatible` when the request's fingerprint differs from ours (a
        request without one, e.g. from a client, is not checked: see docs/security.md)."""
        try:
            raw = json.loads(params_json or "{}").get(PARAM)
        except (ValueError, AttributeError):
            raw = None
        if self.mine is None or not raw:
            return
        try:
            theirs = msgspec.json.decode(raw, type=Fingerprint)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self._refuse("other", f"{INCOMPATIBLE}: unreadable fingerprint ({e})")
        got = refusal(self.mine, theirs)
        if got is not None:
            self._refuse(*got)

    def _refuse(self, reason: str, message: str) -> None:
        with self._lock:
            n = self.refusals[reason] = self.refusals.get(reason, 0) + 1
        if n <= 5 or n & (n - 1) == 0:
            log.error("refused a forwarded request: %s [%d so far]", message, n)
        raise Incompatible(message, reason)  # tagged with its reason (errors.tag_of)

    def merged(self, snap: dict) -> dict:
        """A stage's stats snapshot with these refusals added to its control plane's."""
        total = dict(snap.get("refusals", {}))
        with self._lock:
            for k, n in self.refusals.items():
                total[k] = total.get(k, 0) + n
        snap["refusals"] = total
        return snap
