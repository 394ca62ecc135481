"""The KV events a multi-turn chat and evictions publish, decoded by vLLM's own classes (the
vLLM peer environment, ``benchmarks/setup_vllm_peer.sh``; its Python is ``$VLLM_PEER_PYTHON``
or the benchmarks' default). Skipped, with the reason, where that environment does not exist."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import runtime_models as rm
from kv_events_chat import check_decoded, run_chat

from backends.runtime.loader import load_runner

PEER = os.environ.get("VLLM_PEER_PYTHON", "/work/peer/vllm-venv/bin/python")
SCRIPT = os.path.join(os.path.dirname(__file__), "..", "helpers", "vllm_kv_events_decode.py")


def _peer_or_skip() -> str:
    if not os.access(PEER, os.X_OK):
        pytest.skip(f"no vLLM peer environment at {PEER} (benchmarks/setup_vllm_peer.sh)")
    probe = subprocess.run(
        [PEER, "-c", "import vllm.distributed.kv_events"], capture_output=True, timeout=300
    )
    if probe.returncode:
        pytest.skip(f"{PEER} cannot import vllm.distributed.kv_events: {probe.stderr[-300:]}")
    return PEER


def test_vllm_decodes_chat_events():
    peer = _peer_or_skip()
    run = run_chat(load_runner(rm.checkpoint("llama")))
    stdin = "".join(p.hex() + "\n" for p in run.payloads)
    proc = subprocess.run(
        [peer, SCRIPT], input=stdin, capture_output=True, text=True, timeout=300,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    decoded = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    check_decoded(run, decoded)
    # vLLM's encoder gives back the very bytes this runtime sent
    assert [bytes.fromhex(d["reencoded"]) for d in decoded] == run.payloads


STRUCTS = ("EventBatch", "KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared")
DESCRIBE = """
import json, sys
import vllm.distributed.kv_events as m
out = {}
for name in sys.argv[1:]:
    c = getattr(m, name)
    k = c.__struct_config__
    out[name] = [list(c.__struct_fields__), k.array_like, k.omit_defaults, k.tag, k.tag_field]
print(json.dumps(out))
"""


def test_struct_definitions_are_vllms():
    """Field order and the msgspec options that shape the wire, struct by struct."""
    from backends.runtime.prefix_cache import events

    peer = _peer_or_skip()
    proc = subprocess.run(
        [peer, "-c", DESCRIBE, *STRUCTS], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    theirs = json.loads(proc.stdout.splitlines()[-1])
    for name in STRUCTS:
        c = getattr(events, name)
        k = c.__struct_config__
        assert theirs[name] == [
            list(c.__struct_fields__),
            k.array_like,
            k.omit_defaults,
            k.tag,
            k.tag_field,
        ], name
