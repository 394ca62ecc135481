"""A multi-turn chat through the colocated engine with a prefix cache whose events are encoded
as the publisher sends them, then unrelated requests that evict the chat's blocks; and the
checks both KV event tests run on the decoded batches (ours, and vLLM's own classes)."""

from __future__ import annotations

from dataclasses import dataclass

import runtime_models as rm

from backends.runtime.engine import LLMEngine
from backends.runtime.prefix_cache import KVEventBatch, PrefixCache, encode_batch, external
from backends.runtime.prefix_cache.hashing import block_hashes
from backends.runtime.sampling_params import SamplingParams

P = 4


@dataclass
class ChatRun:
    payloads: list[bytes]  # msgpack KVEventBatch, one per sink call, in order
    chat_batches: int  # how many of them the chat itself produced
    turns: list[list[int]]  # per turn, the tokens whose KV the turn made final
    medium: str  # the cache's (GPU or CPU by the pool's device)
    page_size: int = P


def run_chat(runner, turns: int = 3) -> ChatRun:
    payloads: list[bytes] = []

    def sink(events):
        batch = KVEventBatch(ts=1.5 + len(payloads), events=list(events), data_parallel_rank=0)
        payloads.append(encode_batch(batch))

    pool = runner.make_pool(24, P)
    cache = PrefixCache(pool, events=sink)
    engine = LLMEngine(runner, pool, max_batch=4, prefix_cache=cache)
    done: list[list[int]] = []
    history = rm.random_prompt(9, seed=1)
    for t in range(turns):
        (seq,) = engine.generate([(history, SamplingParams(max_tokens=7, ignore_eos=True))], f"{t}")
        done.append((seq.prompt_ids + seq.output_ids)[: seq.num_tokens - 1])
        history = history + seq.output_ids + rm.random_prompt(3, seed=50 + t)
    chat = len(payloads)
    for i in range(6):  # unrelated requests: the chat's idle blocks are the LRU ones
        prompt = rm.random_prompt(20, seed=900 + i)
        engine.generate([(prompt, SamplingParams(max_tokens=5, ignore_eos=True))], f"u{i}")
    return ChatRun(payloads, chat, done, cache.medium)


def check_decoded(run: ChatRun, batches: list[dict]) -> None:
    """``batches``: the decoded payloads as ``{"ts", "data_parallel_rank", "events": [{"type",
    field: value, ...}]}``. The chat's turns published chained BlockStored events whose token
    ids are the cached blocks' tokens; the unrelated requests' evictions removed chat blocks."""
    P = run.page_size
    assert len(batches) == len(run.payloads)
    stored: dict[int, tuple[int | None, list[int]]] = {}  # hash -> (parent, tokens)
    removed: list[int] = []
    first_parents = []
    for b in batches:
        assert b["data_parallel_rank"] == 0 and isinstance(b["ts"], float)
        for e in b["events"]:
            if e["type"] == "BlockStored":
                assert e["block_size"] == P and e["group_idx"] == 0 and e["medium"] == run.medium
                assert e["lora_id"] is None and e["lora_name"] is None
                assert len(e["token_ids"]) == P * len(e["block_hashes"])
                parent = e["parent_block_hash"]
                first_parents.append(parent)
                for j, h in enumerate(e["block_hashes"]):
                    stored[h] = (parent, e["token_ids"][j * P : (j + 1) * P])
                    parent = h
            else:
                assert e["type"] == "BlockRemoved", e
                assert e["medium"] == run.medium and e["group_idx"] == 0
                removed += e["block_hashes"]
    chat_hashes = set()
    for tokens in run.turns:  # every full block of every turn: stored, chained, its tokens
        parent = None
        for i, h in enumerate(block_hashes(tokens, P)):
            x = external(h)
            assert stored[x] == (parent, tokens[i * P : (i + 1) * P])
            chat_hashes.add(x)
            parent = x
    # later turns continued the chain of earlier ones (their first event has a parent)
    chat_events = [e for b in batches[: run.chat_batches] for e in b["events"]]
    assert chat_events[0]["parent_block_hash"] is None
    assert all(e["parent_block_hash"] in stored for e in chat_events[1:])
    assert set(removed) <= set(stored) and set(removed) & chat_hashes
    assert not any(e["type"] == "BlockRemoved" for e in chat_events)
