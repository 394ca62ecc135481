"""Deployment identity (kvtransfer/protocol/identity.py, backends/stages/fingerprint.py): the key
id never shows the secret, the first differing field names the refusal, a checkpoint's digest
follows its bytes (not its directory), and is computed once per file version."""

import os
import shutil

import msgspec

from backends.stages import fingerprint as fpm
from kvtransfer.protocol.identity import Fingerprint, key_id, mismatch, reason_of, refusal

BASE = Fingerprint(5, key_id("s" * 32), "a" * 32, "m", "", "float32/page16")


def test_key_id_is_stable_short_and_not_the_secret():
    assert key_id("s" * 32) == key_id(b"s" * 32) and len(key_id("s" * 32)) == 16
    assert key_id("s" * 32) != key_id("t" * 32) and "s" * 16 not in key_id("s" * 32)
    assert key_id(None) == key_id("") == "none"


def test_first_differing_field_names_the_refusal():
    r = msgspec.structs.replace
    other = r(BASE, protocol=4, key_id="x", model="b" * 32)
    assert mismatch(BASE, other)[0] == "protocol"  # the version first: nothing else is comparable
    assert mismatch(BASE, other)[1] == "protocol 5 vs 4 (prefill vs decode)"
    assert mismatch(BASE, r(BASE, key_id="x", model="b" * 32))[0] == "secret"
    assert mismatch(BASE, r(BASE, model="b" * 32, model_name="n"))[1] == (
        "model differs: prefill serves m (aaaaaaaaaaaa), decode serves n (bbbbbbbbbbbb)"
    )
    assert mismatch(BASE, r(BASE, kv="float32/page16/crc32c"))[0] == "kv"
    assert mismatch(BASE, r(BASE, model_name="renamed")) is None  # the digest decides
    changes = {
        "protocol": {"protocol": 7},
        "secret": {"key_id": "x"},
        "model": {"model": "c"},
        "draft": {"draft": "self:2"},
        "kv": {"kv": "x"},
    }
    for field, change in changes.items():
        label, msg = refusal(BASE, r(BASE, **change))
        assert label == field and reason_of(msg) == field and msg.startswith("incompatible")


def test_checkpoint_digest_follows_the_bytes(tmp_path):
    a = tmp_path / "a"
    a.mkdir()
    (a / "config.json").write_text('{"x": 1}')
    (a / "model.safetensors").write_bytes(b"\0" * 1000)
    (a / "tokenizer.json").write_text("{}")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    assert fpm.checkpoint_digest(str(a)) == fpm.checkpoint_digest(str(b))
    (b / "tokenizer.json").write_text('{"other": 1}')  # not part of the model's identity
    assert fpm.checkpoint_digest(str(a)) == fpm.checkpoint_digest(str(b))
    with open(b / "model.safetensors", "r+b") as f:
        f.seek(500)
        f.write(b"\1")
    os.utime(b / "model.safetensors", ns=(1, 1))  # a new file version, whatever the clock
    assert fpm.checkpoint_digest(str(a)) != fpm.checkpoint_digest(str(b))
    n = len(fpm._cache)
    fpm.checkpoint_digest(str(a))
    assert len(fpm._cache) == n  # cached by (path, size, mtime)
