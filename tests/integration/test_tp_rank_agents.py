"""A real model's KV moved between a prefill and a decode of different TP sizes, then decoded.

KVSender (prefill rank 0) and KVReceiver (decode rank 0) in this process, every other rank a TP
worker process running its KV agent (kvtransfer/tp/agent.py: own Mooncake engine, staging
slots over its pool shard): decode registers every rank (protocol 6), prefill pairs the ranks
head by head and each rank sends its own shard through slots small enough for several chunks a
piece. Decode then continues from the moved KV (``add_prefilled``) and must give transformers'
greedy tokens. Cases: a GQA model with 2 KV heads at TP 2 -> 1 and 1 -> 2 (staged head slices)
and 2 -> 2 on contiguous pages (direct copies rank to rank), and MLA (DeepSeek-V2) at 2 -> 1,
where the latent leaves prefill rank 0 only.
"""

from __future__ import annotations

import pytest
import runtime_models as rm
import torch

from backends.runtime.engine import LLMEngine
from backends.runtime.loader import load_runner
from backends.runtime.sampling_params import SamplingParams
from kvtransfer import TransferConfig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
PAGE, N_NEW = 4, 12


def load(kind: str, tp: int):
    return load_runner(rm.checkpoint(kind), device="cpu", tensor_parallel_size=tp)


CASES = [("qwen2_kv2", 2, 1), ("qwen2_kv2", 1, 2), ("deepseek_v2", 2, 1)]
CONTIGUOUS = ("qwen2_kv2", 2, 2, True)  # same TP, long page runs: direct copies rank to rank


STAGE = TransferConfig(host="127.0.0.1", staging_slot_bytes=1024)  # several chunks per piece


def stage_sides(p_run, d_run, p_pool, d_pool, d_agents=True):
    from kvtransfer import KVReceiver, KVSender

    def agents(run, pool, slots):
        if not hasattr(run, "kv_agents"):
            return []
        return run.kv_agents({"target": pool}, STAGE, slots, STAGE.staging_slot_bytes)

    tx = KVSender(STAGE, {"target": p_pool.layout}, {"target": p_pool.tensor},
                  agents(p_run, p_pool, STAGE.staging_slots))  # fmt: skip
    d_ranks = agents(d_run, d_pool, STAGE.staging_recv_slots) if d_agents else []
    rx = KVReceiver(STAGE, {"target": d_pool.layout}, {"target": d_pool.tensor}, d_ranks)
    return tx, rx


def pd_room(kind, p_run, d_run, prompt, d_agents=True, contiguous=False):
    """One room through KVSender -> KVReceiver; (status, reason, decode pool, its pages, first,
    the sender's staging counters)."""
    p_pool, d_pool = p_run.make_pool(16, PAGE), d_run.make_pool(16, PAGE)
    for seed, pool in enumerate((p_pool, d_pool)):
        if not contiguous:
            pool.shuffle_free_list(seed)
    n = p_pool.pages_needed(len(prompt))
    src_pages, dst_pages = p_pool.alloc(n), d_pool.alloc(n)
    tx, rx = stage_sides(p_run, d_run, p_pool, d_pool, d_agents)
    try:
        rx.register(7, [tx.bootstrap_addr], {"target": dst_pages}, len(prompt), lambda r, s: None)
        tx.start_room(7, {"target": src_pages})
        send = lambda a, b: tx.send_group(7, "target", range(a, b))  # noqa: E731
        logits = p_run.prefill(p_pool, prompt, src_pages, groups=[(0, 2), (2, 4)], on_group=send)
        first = int(torch.argmax(logits))
        tx.finish(7, first)
        status = rx.wait(7, 60)
        return status.name, rx.failure_reason(7), d_pool, dst_pages, first, tx.staging.counts
    finally:
        tx.close()
        rx.close()


@pytest.mark.parametrize(("kind", "p_tp", "d_tp", "contiguous"),
                         [(*c, False) for c in CASES] + [CONTIGUOUS])  # fmt: skip
def test_kvsender_to_kvreceiver_across_tp_sizes(kind, p_tp, d_tp, contiguous):
    prompt = rm.random_prompt(19, seed=4)
    want = rm.hf_greedy(kind, prompt, N_NEW)
    p_run, d_run = load(kind, p_tp), load(kind, d_tp)
    try:
        status, why, d_pool, pages, first, staged = pd_room(kind, p_run, d_run, prompt,
                                                            contiguous=contiguous)  # fmt: skip
        assert status == "Success", why
        if contiguous:  # every piece a whole shard with long runs: no staging at all
            assert staged["chunks"] == 0
        else:  # several slot-sized chunks per piece, rank 0's own
            assert staged["chunks"] >= 2 * 2
        engine = LLMEngine(d_run, d_pool, max_batch=1)
        seq = engine.add_prefilled("r", prompt, pages, first, SamplingParams(max_tokens=N_NEW))
        while engine.has_unfinished():
            engine.step()
        assert seq.output_ids == want
    finally:
        for r in (p_run, d_run):
            if hasattr(r, "close"):
                r.close()
