"""End-to-end KV integrity (``kv_checksum``) between two processes over real Mooncake: the
checksums of target and draft entries agree after direct and staged transfers, and one flipped
bit in the landed KV (``KVTRANSFER_FAULTS=flip=1`` in decode's environment) fails the room with
a clear error before it could run, with every page freed on both sides."""

import pytest
from test_transfer_failures import ENTRIES, GROUPS, start

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def test_checksums_agree_staged_and_direct(spawn):
    prefill = spawn("prefill", ENTRIES, kv_checksum=True)
    decode = spawn("decode", ENTRIES, kv_checksum=True)
    free0 = (prefill.free_counts(), decode.free_counts())
    start(prefill, decode, 1)  # fragmented page tables: staged chunks, scattered by decode
    prefill.alloc_pages(2, {"target": 6, "draft": 6}, fragmented=False)  # one direct run each
    decode.alloc_pages(2, {"target": 8, "draft": 8}, fragmented=False)
    decode.register(2, [prefill.info["bootstrap_addr"]], 90)
    prefill.start_room(2)
    prefill.run_prefill(2, GROUPS, 0.0, 0.0, 42, None)
    for room in (1, 2):
        assert tuple(decode.wait(room, 60)) == ("Success", "")
        for role in ("target", "draft"):
            assert decode.digest(room, role, 6) == prefill.digest(room, role, 6)
        decode.free_room(room)
    assert (prefill.free_counts(), decode.free_counts()) == free0


def test_a_flipped_bit_fails_the_room(spawn, monkeypatch):
    prefill = spawn("prefill", ENTRIES, kv_checksum=True)
    monkeypatch.setenv("KVTRANSFER_FAULTS", "flip=1")
    decode = spawn("decode", ENTRIES, kv_checksum=True)
    monkeypatch.delenv("KVTRANSFER_FAULTS")
    free0 = (prefill.free_counts(), decode.free_counts())
    start(prefill, decode, 1)
    status, reason = decode.wait(1, 60)
    assert status == "Failed"
    assert reason.startswith("KV checksum mismatch: target layer 0 (prefill ")
    assert "the bytes that landed are not the bytes prefill computed" in reason
    assert prefill.wait(1, 30)[0] == "Success"  # prefill did its part
    assert (prefill.free_counts(), decode.free_counts()) == free0


def test_decode_that_wants_checksums_refuses_a_prefill_without(spawn):
    prefill = spawn("prefill", ENTRIES)
    decode = spawn("decode", ENTRIES, kv_checksum=True)
    start(prefill, decode, 1)
    status, reason = decode.wait(1, 60)
    assert status == "Failed" and "KV checksum missing for ['draft', 'target']" in reason
