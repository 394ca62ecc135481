"""A stage's deployment identity (kvtransfer/identity.py) from its parameters.

The model's identity is a digest of its checkpoint: ``config.json`` and every weight file
(``*.safetensors``, ``*.bin``, ``*.gguf``), names and contents, BLAKE2b. Hashing is done once per
process and file version (path, size, mtime): SmolLM2-135M's 517 MB took 0.5 s here. Two copies
of the same checkpoint in different directories have the same digest; a fine-tune of the same
architecture (same config, other weights) has another.
"""

from __future__ import annotations

import hashlib
import os
import threading

from kvtransfer.identity import Identity, fingerprint
from kvtransfer.messages import PROTOCOL_VERSION

from .params import StageParams

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


def stage_identity(p: StageParams) -> Identity:
    """Model, draft and KV identity of the deployment these parameters describe."""
    draft = ""
    if p.spec_enabled:
        draft = checkpoint_digest(p.draft_path) if p.draft_path else f"self:{p.draft_layers}"
    name = os.path.basename(os.path.normpath(p.model_path))
    return Identity(checkpoint_digest(p.model_path), name, draft, f"{p.dtype}/page{p.page_size}")


def stage_fingerprint(p: StageParams):
    """The full fingerprint (protocol, key id of the secret in effect, identity)."""
    return fingerprint(stage_identity(p), p.secret or None, PROTOCOL_VERSION)
