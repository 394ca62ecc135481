"""KV events in vLLM's wire format (vLLM 0.32.0's ``vllm.distributed.kv_events``): the raw
msgpack layout, byte for byte against a structure written out by hand; the ZMQ framing of the
publisher and its replay socket; and the events a multi-turn chat and evictions publish.
(``test_kv_events_vllm.py`` decodes them with vLLM's own classes where vLLM is installed.)"""

from __future__ import annotations

import time

import msgspec
import pytest
import runtime_models as rm
import zmq
from kv_events_chat import check_decoded, run_chat

from backends.runtime.loader import load_runner
from backends.runtime.prefix_cache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventPublisher,
    decode_batch,
    encode_batch,
)
from backends.runtime.prefix_cache.events import VLLM_MIRRORED
from backends.runtime.prefix_cache.publisher import END_SEQ, binds

BIG = 0xFFFFFFFFFFFFFFFF  # a hash needing msgpack's uint64


def sample_batch() -> KVEventBatch:
    stored = BlockStored(
        block_hashes=[BIG, 7], parent_block_hash=3, token_ids=list(range(8)), block_size=4,
        lora_id=None, medium="GPU", lora_name=None, group_idx=0,
    )  # fmt: skip
    removed = BlockRemoved(block_hashes=[7], medium="GPU", group_idx=0)
    return KVEventBatch(ts=12.5, events=[stored, removed, AllBlocksCleared()], data_parallel_rank=0)


def test_layout_is_vllms_byte_for_byte():
    """The batch is an array [ts, events, data_parallel_rank]; each event a map tagged by
    "type" with vLLM's field order; defaulted fields left out, required ones even as nil."""
    want = [
        12.5,
        [
            {
                "type": "BlockStored",
                "block_hashes": [BIG, 7],
                "parent_block_hash": 3,
                "token_ids": list(range(8)),
                "block_size": 4,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "group_idx": 0,
            },
            {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "group_idx": 0},
            {"type": "AllBlocksCleared"},
        ],
        0,
    ]
    payload = encode_batch(sample_batch())
    assert payload == msgspec.msgpack.encode(want)  # plain lists and dicts: no struct options
    raw = msgspec.msgpack.decode(payload)
    assert list(raw[1][0]) == list(want[1][0])  # key order too
    assert decode_batch(payload) == sample_batch()
    # a batch without a rank still has the slot: omit_defaults never shortens an array
    bare = encode_batch(KVEventBatch(ts=1.0, events=[AllBlocksCleared()]))
    assert msgspec.msgpack.decode(bare) == [1.0, [{"type": "AllBlocksCleared"}], None]
    # the optional fields are there when set (bytes hashes: VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)
    full = BlockStored(
        block_hashes=[b"\x01" * 32], parent_block_hash=None, token_ids=[1], block_size=1,
        lora_id=2, medium=None, lora_name="a", extra_keys=[("salt",)], group_idx=1,
        kv_cache_spec_kind="full", kv_cache_spec_sliding_window=None, locality="LOCAL",
        ownership="x", session_id="s",
    )  # fmt: skip
    keys = list(msgspec.msgpack.decode(encode_batch(KVEventBatch(0.0, [full])))[1][0])
    assert keys == [
        "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
        "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "locality",
        "ownership", "session_id",
    ]  # fmt: skip
    assert VLLM_MIRRORED == "0.32.0"


def test_bind_rule_is_vllms():
    assert binds("tcp://*:5557") and binds("ipc:///tmp/x") and binds("tcp://[::]:5557")
    assert not binds("tcp://epp.llm-d:5557")  # connect to a scheduler that binds


def _recv(sock, timeout_ms: int = 5000):
    assert sock.poll(timeout_ms), "nothing received"
    return sock.recv_multipart()


def test_publisher_framing_and_replay():
    ctx = zmq.Context.instance()
    pub = KVEventPublisher(
        "tcp://127.0.0.1:0", topic="kv@10.0.0.1@m", replay_endpoint="tcp://127.0.0.1:0",
        bind=True, buffer_steps=2,
    )  # fmt: skip
    sub = ctx.socket(zmq.SUB)
    dealer = ctx.socket(zmq.DEALER)
    try:
        assert pub.endpoint.startswith("tcp://127.0.0.1:")
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        sub.connect(pub.endpoint)
        time.sleep(0.3)  # a SUB joins late: what is sent before it connected is lost
        batches = sample_batch().events
        for i, e in enumerate(batches):
            pub.put([e])
            topic, seq, payload = _recv(sub)
            assert topic == b"kv@10.0.0.1@m" and seq == i.to_bytes(8, "big")
            got = decode_batch(payload)
            assert got.events == [e] and got.data_parallel_rank == 0
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replies = [_recv(dealer) for _ in range(3)]  # the buffer keeps the last 2 batches
        assert [r[:3] for r in replies[:2]] == [
            [b"", b"kv@10.0.0.1@m", (1).to_bytes(8, "big")],
            [b"", b"kv@10.0.0.1@m", (2).to_bytes(8, "big")],
        ]
        assert decode_batch(replies[1][3]).events == [batches[2]]
        assert replies[2] == [b"", b"", END_SEQ, b""]
        assert pub.sent == 3 and pub.dropped == 0
    finally:
        sub.close(0)
        dealer.close(0)
        pub.close()
    assert not pub._thread.is_alive()


def test_publisher_refuses_a_bad_endpoint_at_once():
    with pytest.raises(zmq.ZMQError):
        KVEventPublisher("tcp://256.1.1.1:5557", bind=True)


@pytest.fixture(scope="module")
def llama():
    return load_runner(rm.checkpoint("llama"))


def test_multi_turn_chat_events(llama):
    run = run_chat(llama)
    decoded = []
    for payload in run.payloads:
        b = decode_batch(payload)
        events = [{"type": type(e).__name__, **msgspec.structs.asdict(e)} for e in b.events]
        decoded.append({"ts": b.ts, "data_parallel_rank": b.data_parallel_rank, "events": events})
    check_decoded(run, decoded)
