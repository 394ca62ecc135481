"""Tensor parallelism of the recurrent hybrids: 2 ranks (rank 0 here, rank 1 a spawned worker)
against transformers and against one rank, on the tiny checkpoints (float32; bfloat16 up to a
tie).

Each rank holds half of the state's head groups (2 in every tiny hybrid): Qwen3-Next / Qwen3.5
one key head and its 2 value heads of each gated DeltaNet layer, Nemotron-H / Granite 4.0-H one
B/C group and its 2 heads of each Mamba2 layer; attention splits its 4 heads and 2 KV heads,
the MLPs and experts their intermediate dimension. A rank's state slot after a prefill is the
matching groups of the one-rank slot, sub-block by sub-block (what lets the state move between
TP sizes): checked on both ranks built in this process.
"""

from __future__ import annotations

import threading

import pytest
import runtime_models as rm
import torch

from backends.runtime.engine import LLMEngine
from backends.runtime.loader import load_runner
from backends.runtime.paged import SeqInput
from backends.runtime.sampling_params import SamplingParams
from backends.runtime.state_pool import pool_entries
from backends.runtime.tp.comm import TPGroup, join_store, make_store
from backends.runtime.tp.rank import ShardRunner, load_config, load_shard
from backends.runtime.tp.shard import ShardPlan
from kvtransfer.memory.layout import state_runs

KINDS = ["qwen3_next", "nemotron_h"]  # a gated DeltaNet and a Mamba2 hybrid
ALL_KINDS = [*KINDS, "qwen3_5", "granite_hybrid"]  # + split projections, Granite's blocks


@pytest.fixture(scope="module", params=KINDS)
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def runners(kind):
    """(one rank, two ranks) over ``kind``'s checkpoint."""
    path = rm.checkpoint(kind)
    two = load_runner(path, device="cpu", tensor_parallel_size=2)
    try:
        yield load_runner(path, device="cpu"), two
    finally:
        two.close()


def test_each_rank_holds_its_state_groups(runners):
    tp1, tp2 = runners
    whole = tp1.make_pool(4, 8, num_slots=3).states.layout
    pool = tp2.make_pool(4, 8, num_slots=3)
    layouts = tp2.shard_layouts(pool.states)
    assert layouts[0] == pool.states.layout and pool.states.num_slots == 3
    assert [(x.head_start, x.kv_heads, x.total_kv_heads) for x in layouts] == [(0, 1, 2), (1, 1, 2)]
    assert layouts[1].base_addr not in (0, layouts[0].base_addr)  # the worker's own buffer
    for x in layouts:  # a group's sub-blocks and sizes are the whole model's
        assert (x.role, x.segments, x.head_dim) == (whole.role, whole.segments, whole.head_dim)
        assert (x.num_layers, x.num_pages) == (whole.num_layers, 3)
    assert pool.states.slabs.shape == (whole.num_layers, 3, whole.head_dim)  # half the slot
    # a window-less pool's KV entry is split as for any GQA model: one KV head per rank
    assert [x.head_start for x in tp2.shard_layouts(pool)] == [0, 1]
    # the entries a stage registers name the same shards (what kv_agents takes)
    entries = pool_entries(pool)
    assert list(entries) == ["target", "target.state"]
    assert tp2.shard_layouts(entries["target.state"]) == layouts


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_logits_match_transformers_and_one_rank(kind):
    """A 70-token prompt (two DeltaNet chunks, five Mamba2 chunks, nine pages) in layer groups:
    every position's logits as transformers', the last one's as a one-rank prefill's."""
    prompt = rm.random_prompt(70, seed=3)
    with torch.no_grad():
        ref = rm.hf_model(kind)(torch.tensor([prompt])).logits[0].float()  # [T, V]
    one = load_runner(rm.checkpoint(kind), device="cpu")
    pool1 = one.make_pool(16, 8)
    pages = pool1.alloc(pool1.pages_needed(70))
    single = one.prefill(pool1, prompt, pages, slot=pool1.states.alloc())
    runner = load_runner(rm.checkpoint(kind), device="cpu", tensor_parallel_size=2)
    try:
        pool = runner.make_pool(16, 8)
        pool.shuffle_free_list(seed=1)
        seq = SeqInput(prompt, 0, pool.alloc(pool.pages_needed(70)), pool.states.alloc())
        rm.assert_close_to_reference(runner.forward(pool, [seq])[0], ref)
        seen = []
        slot = pool.states.alloc()
        last = runner.prefill(
            pool, prompt, seq.pages, [(0, 2), (2, 4)], lambda a, b: seen.append((a, b)), 0, slot
        )
    finally:
        runner.close()
    assert seen == [(0, 2), (2, 4)]
    torch.testing.assert_close(last, single, atol=1e-5, rtol=1e-5)
    rm.assert_close_to_reference(last, ref[-1])


def test_greedy_matches_transformers_generate(kind, runners):
    """Two prompts generated together, 24 tokens each: transformers' tokens, one by one."""
    tp2 = runners[1]
    prompts = [rm.random_prompt(n, seed=30 + n) for n in (9, 77)]
    engine = LLMEngine(tp2, tp2.make_pool(32, 8), max_batch=2)
    seqs = engine.generate([(p, SamplingParams(max_tokens=24)) for p in prompts])
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.output_ids == rm.hf_greedy(kind, prompt, 24)
    assert len({t for s in seqs for t in s.output_ids}) > 8  # not one repeated token


def test_chunked_prefill_carries_the_state(kind, runners):
    """A prompt prefilled in three chunks (boundaries inside the algorithms' chunks and pages)
    gives one rank's one-shot logits, and greedy decoding from it equals transformers'."""
    tp1, tp2 = runners
    prompt = rm.random_prompt(100, seed=6)
    pool1 = tp1.make_pool(64, 8)
    pages1 = pool1.alloc(pool1.pages_needed(100))
    whole = tp1.prefill(pool1, prompt, pages1, slot=pool1.states.alloc())
    pool = tp2.make_pool(64, 8)
    pages, slot = pool.alloc(pool.pages_needed(len(prompt) + 8)), pool.states.alloc()
    for a, b in ((0, 37), (37, 70), (70, 100)):
        last = tp2.prefill(pool, prompt[a:b], pages, start_pos=a, slot=slot)
    rm.assert_close_to_reference(last, whole)
    rm.assert_greedy_continues(kind, tp2, pool, pages, slot, prompt, last)


def test_batched_greedy_with_sequences_joining_and_leaving(kind, runners):
    """As one rank does (the helper's docstring), each rank advancing the slots rank 0 names."""
    rm.assert_slots_join_and_leave(kind, runners[1])


@pytest.mark.parametrize("kind", KINDS)
def test_bfloat16_greedy_matches_transformers_bfloat16(kind):
    """Two ranks in bfloat16 (their partial sums rounded before the all_reduce) against
    transformers in bfloat16: equal up to a tie of its own logits (as one rank is held)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(rm.checkpoint(kind), dtype=torch.bfloat16).eval()
    prompts = [rm.random_prompt(n, seed=20 + n) for n in (9, 90)]
    runner = load_runner(rm.checkpoint(kind), dtype="bfloat16", tensor_parallel_size=2)
    try:
        pool = runner.make_pool(64, 8)
        assert pool.tensor.dtype == torch.bfloat16 and pool.states.slabs.dtype == torch.float32
        engine = LLMEngine(runner, pool, max_batch=2)
        seqs = engine.generate([(p, SamplingParams(max_tokens=16)) for p in prompts])
    finally:
        runner.close()
    equal = 0
    for prompt, seq in zip(prompts, seqs, strict=True):
        want = rm.greedy_generate(hf, prompt, 16)
        equal += rm.assert_greedy_matches_up_to_tie(hf, prompt, seq.output_ids, want, rm.BF16_TIE)
    assert equal >= 16  # at most one of the two parts at a tie, and not at once


def _ranks_in_process(kind: str, size: int) -> list[ShardRunner]:
    """Every rank of a ``size``-way runner built in this process (threads join the group), so
    a test can read each rank's memory."""
    path = rm.checkpoint(kind)
    cfg, store = load_config(path, None), make_store(30.0)
    ranks: list = [None] * size

    def build(r: int) -> None:
        plan = ShardPlan.build(cfg, size, r)
        tensors = load_shard(path, cfg, plan, "float32", "cpu")
        st = store if r == 0 else join_store(store.port, 30.0)
        group = TPGroup(st, r, size, "cpu", 30.0)
        group.step_open = True  # no TPModelRunner opens steps here: the threads run in step
        ranks[r] = ShardRunner.build(path, cfg, tensors, plan, group, "float32", "cpu")

    _in_threads([lambda r=r: build(r) for r in range(size)])
    return ranks


def _in_threads(fns: list) -> list:
    """Run each of ``fns`` in a thread of its own, at once (ranks meet in collectives)."""
    out, errors = [None] * len(fns), []

    def run(i: int) -> None:
        try:
            out[i] = fns[i]()
        except Exception as e:  # re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_a_rank_slot_is_its_groups_of_the_one_rank_slot(kind):
    """After the same chunked prefill, rank k's slot of every recurrent layer equals groups
    ``[head_start, head_start + kv_heads)`` of the one-rank slot, taken from each sub-block on
    its own (``state_runs``): conv [q | k | v] / [x | B | C] channels and recurrent state."""
    prompt = rm.random_prompt(90, seed=9)
    one = load_runner(rm.checkpoint(kind), device="cpu")
    pool1 = one.make_pool(16, 8)
    slot1, pages = pool1.states.alloc(), pool1.alloc(pool1.pages_needed(90))
    for a, b in ((0, 50), (50, 90)):
        one.prefill(pool1, prompt[a:b], pages, start_pos=a, slot=slot1)
    ranks = _ranks_in_process(kind, 2)
    pools = [r.make_pool(16, 8) for r in ranks]
    slots = [p.states.alloc() for p in pools]
    for a, b in ((0, 50), (50, 90)):
        _in_threads(
            [
                lambda r=r, p=p, s=s, a=a, b=b: r.prefill(
                    p, prompt[a:b], pages, start_pos=a, slot=s
                )
                for r, p, s in zip(ranks, pools, slots, strict=True)
            ]
        )
    whole = pool1.states.layout
    for pool, slot in zip(pools, slots, strict=True):
        lay = pool.states.layout
        runs = state_runs(whole, lay.head_start, lay.kv_heads)
        want = torch.cat([pool1.states.slabs[:, slot1, a : a + n] for a, n in runs], dim=1)
        got = pool.states.slabs[:, slot]  # [layers, the rank's slot]
        assert got.shape == want.shape and got.abs().sum() > 0
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_size_that_does_not_divide_the_state_groups_is_refused():
    """4 ranks split the tiny hybrids' 4 attention heads but not their 2 state groups."""
    for kind in ("qwen3_next", "nemotron_h"):
        with pytest.raises(ValueError, match=r"tensor_parallel_size 4 does not divide the 2 head"):
            load_runner(rm.checkpoint(kind), device="cpu", tensor_parallel_size=4)
