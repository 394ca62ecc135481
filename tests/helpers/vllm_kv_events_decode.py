"""Run by the vLLM peer's Python (never this project's): decode KV event payloads with vLLM's
own ``vllm.distributed.kv_events.KVEventBatch`` and re-encode them with vLLM's encoder.

stdin: one hex payload a line. stdout: one JSON line a payload: ``{"ts", "data_parallel_rank",
"events": [{"type": class name, field: value}], "reencoded": hex of vLLM's encoding}``.
"""

import json
import sys

import msgspec
from vllm.distributed.kv_events import KVEventBatch

decoder = msgspec.msgpack.Decoder(KVEventBatch)
encoder = msgspec.msgpack.Encoder()
for line in sys.stdin:
    batch = decoder.decode(bytes.fromhex(line.strip()))
    events = [{"type": type(e).__name__, **msgspec.structs.asdict(e)} for e in batch.events]
    out = {"ts": batch.ts, "data_parallel_rank": batch.data_parallel_rank, "events": events}
    out["reencoded"] = encoder.encode(batch).hex()
    print(json.dumps(out))
