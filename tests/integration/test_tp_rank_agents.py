"""A real model's KV moved between a prefill and a decode of different TP sizes, then decoded.

The TP runner's worker ranks run their KV agents (kvtransfer/rank_agent.py: own Mooncake
engine, staging slots over the rank's pool shard, in the worker process); rank 0's part uses a
RankShards of its own in this process. The test plays the control plane: for every piece
:func:`~kvtransfer.layout.shard_pieces` plans, each slot-sized chunk is gathered on its prefill
rank, written with one Mooncake write into a slot of its decode rank and scattered there. Then
decode continues from the moved KV (``add_prefilled``) and must give transformers' greedy tokens.
Cases: a GQA model with 2 KV heads at TP 2 -> 1 and 1 -> 2, and MLA (DeepSeek-V2) at 2 -> 1,
where the latent leaves prefill rank 0 only.
"""

from __future__ import annotations

import threading
from dataclasses import astuple

import pytest
import runtime_models as rm
import torch

from backends.runtime.engine import LLMEngine
from backends.runtime.runner import ModelRunner
from backends.runtime.sampler import SamplingParams
from kvtransfer import TransferConfig
from kvtransfer.engine import Engine
from kvtransfer.layout import shard_pieces
from kvtransfer.rank_agent import Chunk
from kvtransfer.shards import RankShards, piece_chunks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
SLOTS, SLOT_BYTES, PAGE, N_NEW = 2, 2048, 4, 12
CONFIG = TransferConfig(host="127.0.0.1")


class Side:
    """One stage's ranks for the test: rank 0's RankShards here, agents for ranks 1..N-1."""

    def __init__(self, runner, pool):
        self.runner, self.pool = runner, pool
        self.engine = Engine(CONFIG)
        lay = pool.layout
        self.local = RankShards(self.engine, {"target": pool.tensor}, {"target": lay}, SLOTS,
                                SLOT_BYTES)  # fmt: skip
        self.agents = []
        self.layouts = [lay]
        if hasattr(runner, "kv_agents"):
            self.agents = runner.kv_agents({"target": pool}, CONFIG, SLOTS, SLOT_BYTES)
            self.layouts += [a.layouts()["target"] for a in self.agents]
        self.sends = [0] * len(self.layouts)

    def session(self, rank: int) -> str:
        return self.engine.session_id if rank == 0 else self.agents[rank - 1].info.session_id

    def slot_addr(self, rank: int) -> int:
        return self.local.slot_addr(0) if rank == 0 else self.agents[rank - 1].info.slot_addrs[0]

    def close(self) -> None:
        for a in self.agents:
            a.close()
        self.engine.close()


def wait_for(fn, *args) -> None:
    """Run an agent command (its callback last) and wait until it is answered ok."""
    done, got = threading.Event(), []
    fn(*args, lambda ok, err: (got.append((ok, err)), done.set()))
    assert done.wait(60) and got[0][0], got


def move(src: Side, dst: Side, src_pages: list[int], dst_pages: list[int], layers: int) -> None:
    pieces = shard_pieces(src.layouts, dst.layouts)
    for piece in pieces:
        for chunk in piece_chunks(piece, src.layouts[piece.src], len(src_pages), range(layers),
                                  SLOT_BYTES):  # fmt: skip
            out = Chunk(astuple(piece), src_pages, 0, layers, *chunk)
            session, addr = dst.session(piece.dst), dst.slot_addr(piece.dst)
            src.sends[piece.src] += 1
            if piece.src == 0:
                assert src.local.send(*out.args(), 0, session, addr)
            else:
                wait_for(src.agents[piece.src - 1].send, out, session, addr)
            back = Chunk(astuple(piece), dst_pages, 0, layers, *chunk)
            if piece.dst == 0:
                dst.local.receive(*back.args(), 0)
            else:
                wait_for(dst.agents[piece.dst - 1].scatter, back, 0)


def load(kind: str, tp: int):
    return ModelRunner.load(rm.checkpoint(kind), device="cpu", tensor_parallel_size=tp)


CASES = [("qwen2_kv2", 2, 1), ("qwen2_kv2", 1, 2), ("deepseek_v2", 2, 1)]


@pytest.mark.parametrize(("kind", "p_tp", "d_tp"), CASES)
def test_prefill_tp_to_decode_tp_then_greedy_equals_transformers(kind, p_tp, d_tp):
    prompt = rm.random_prompt(19, seed=3)
    want = rm.hf_greedy(kind, prompt, N_NEW)
    p_run, d_run = load(kind, p_tp), load(kind, d_tp)
    sides = []
    try:
        p_pool, d_pool = p_run.make_pool(16, PAGE), d_run.make_pool(16, PAGE)
        for seed, pool in enumerate((p_pool, d_pool)):
            pool.shuffle_free_list(seed)  # fragmented page tables
        n = p_pool.pages_needed(len(prompt))
        src_pages, dst_pages = p_pool.alloc(n), d_pool.alloc(n)
        logits = p_run.prefill(p_pool, prompt, src_pages)
        first = int(torch.argmax(logits))
        sides = [Side(p_run, p_pool), Side(d_run, d_pool)]
        move(*sides, src_pages, dst_pages, p_pool.layout.num_layers)
        if kind.startswith("deepseek"):  # the latent: from prefill rank 0 only, once per rank
            assert sides[0].sends[1] == 0 and sides[0].sends[0] > 0
        else:  # each prefill rank sent its own head
            assert all(sides[0].sends)
        engine = LLMEngine(d_run, d_pool, max_batch=1)
        seq = engine.add_prefilled("r", prompt, dst_pages, first, SamplingParams(max_tokens=N_NEW))
        while engine.has_unfinished():
            engine.step()
        assert seq.output_ids == want
    finally:
        for s in sides:
            s.close()
        for r in (p_run, d_run):
            if hasattr(r, "close"):
                r.close()


# ---- the control plane: KVSender / KVReceiver with rank agents (protocol 6) ----------------
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


def pd_room(kind, p_run, d_run, prompt, d_agents=True):
    """One room through KVSender -> KVReceiver; (status, reason, decode pool, its pages, first)."""
    p_pool, d_pool = p_run.make_pool(16, PAGE), d_run.make_pool(16, PAGE)
    for seed, pool in enumerate((p_pool, d_pool)):
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
        return status.name, rx.failure_reason(7), d_pool, dst_pages, first, tx.staged
    finally:
        tx.close()
        rx.close()


@pytest.mark.parametrize(("kind", "p_tp", "d_tp"), CASES + [("qwen2_kv2", 2, 2)])
def test_kvsender_to_kvreceiver_across_tp_sizes(kind, p_tp, d_tp):
    prompt = rm.random_prompt(19, seed=4)
    want = rm.hf_greedy(kind, prompt, N_NEW)
    p_run, d_run = load(kind, p_tp), load(kind, d_tp)
    try:
        status, why, d_pool, pages, first, staged = pd_room(kind, p_run, d_run, prompt)
        assert status == "Success", why
        assert staged["chunks"] >= 2 * 2  # several slot-sized chunks per piece, rank 0's own
        engine = LLMEngine(d_run, d_pool, max_batch=1)
        seq = engine.add_prefilled("r", prompt, pages, first, SamplingParams(max_tokens=N_NEW))
        while engine.has_unfinished():
            engine.step()
        assert seq.output_ids == want
    finally:
        for r in (p_run, d_run):
            if hasattr(r, "close"):
                r.close()


def test_decode_ranks_not_covering_every_head_are_refused_at_the_handshake():
    """A TP-2 decode that declares only rank 0 (head 0 of 2): refused before any byte moves."""
    p_run, d_run = load("qwen2_kv2", 2), load("qwen2_kv2", 2)
    try:
        status, why, *_ = pd_room("qwen2_kv2", p_run, d_run, rm.random_prompt(9, 1), False)
        assert status == "Failed"
        assert "incompatible tensor parallelism" in why and "not all 2" in why, why
    finally:
        p_run.close()
        d_run.close()
