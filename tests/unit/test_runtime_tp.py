"""Tensor parallelism in the runtime: 2 ranks (rank 0 here, rank 1 a spawned worker) against
transformers on tiny random checkpoints, in float32.

* ``qwen2_kv2``: 4 heads, 2 KV heads: one KV head per rank (split);
* ``qwen2``: 4 heads, 1 KV head: the KV head replicated on both ranks;
* ``deepseek_v2``: MLA (latent replicated, heads split) + MoE (each expert's intermediate split);
* ``deepseek_v3``: the same with a q LoRA (``q_b_proj`` split by head) and sigmoid routing.
"""

from __future__ import annotations

import pytest
import runtime_models as rm
import torch

from backends.runtime.engine import LLMEngine
from backends.runtime.loader import load_runner
from backends.runtime.paged import SeqInput
from backends.runtime.runner import ModelRunner
from backends.runtime.sampling_params import SamplingParams
from backends.runtime.tp.runner import TPModelRunner

KINDS = ["qwen2_kv2", "qwen2", "deepseek_v2", "deepseek_v3"]


@pytest.fixture(scope="module", params=KINDS)
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def tp2(kind):
    runner = load_runner(rm.checkpoint(kind), device="cpu", tensor_parallel_size=2)
    yield runner
    runner.close()


def test_rank0_pool_holds_its_kv_head_shard(kind, tp2):
    assert isinstance(tp2, TPModelRunner) and len(tp2.worker_pids) == 1
    layout = tp2.make_pool(4, 4).layout
    if kind.startswith("deepseek"):  # the latent is replicated: the whole entry on every rank
        assert (layout.attn, layout.kv_heads, layout.head_dim) == ("mla", 1, 16 + 8)
    elif kind == "qwen2_kv2":
        assert (layout.kv_heads, layout.head_start, layout.total_kv_heads) == (1, 0, 2)
    else:  # 1 KV head for 2 ranks: rank 0 holds (a copy of) head 0
        assert (layout.kv_heads, layout.head_start, layout.total_kv_heads) == (1, 0, 1)
    assert tp2.model.layers[0].attn.H == 2  # 4 query heads, 2 per rank


def test_every_rank_describes_its_shard_of_a_pool(kind, tp2):
    pool = tp2.make_pool(6, 4)
    layouts = tp2.shard_layouts(pool)
    assert len(layouts) == 2 and layouts[0] == pool.layout
    assert {(x.num_pages, x.page_size, x.num_layers) for x in layouts} == {(6, 4, 4)}
    assert layouts[1].base_addr not in (0, pool.layout.base_addr)  # the worker's own buffer
    heads = [(x.head_start, x.kv_heads, x.total_kv_heads) for x in layouts]
    if kind.startswith("deepseek"):
        assert heads == [(0, 1, 0)] * 2 and {x.head_dim for x in layouts} == {24}
    elif kind == "qwen2_kv2":
        assert heads == [(0, 1, 2), (1, 1, 2)]
    else:
        assert heads == [(0, 1, 1), (0, 1, 1)]  # the one KV head on both ranks


def test_logits_match_transformers(kind, tp2):
    prompt, ref = rm.forward_vs_transformers(kind, tp2)
    pool = tp2.make_pool(16, 4)
    pages = pool.alloc(pool.pages_needed(len(prompt)))
    seen = []
    last = tp2.prefill(
        pool, prompt, pages, groups=[(0, 2), (2, 4)], on_group=lambda a, b: seen.append((a, b))
    )
    assert seen == [(0, 2), (2, 4)]
    rm.assert_close_to_reference(last, ref[-1])


@pytest.mark.parametrize("seed", [0, 7])
def test_greedy_matches_transformers_generate(kind, tp2, seed):
    rm.assert_greedy_generate_matches(kind, tp2, seed)


def test_batched_greedy_over_fragmented_pages(kind, tp2):
    prompts = [rm.random_prompt(n, seed=n) for n in (3, 11, 6)]
    expected = [rm.hf_greedy(kind, p, 12) for p in prompts]
    pool = tp2.make_pool(24, 4)
    pool.shuffle_free_list(seed=3)  # page ids differ from slots: every rank must use the same
    engine = LLMEngine(tp2, pool, max_batch=3)
    seqs = engine.generate([(p, SamplingParams(max_tokens=12)) for p in prompts])
    assert [s.output_ids for s in seqs] == expected
    assert pool.num_free == 24


def test_bad_input_is_refused_before_the_ranks_start(tp2):
    pool = tp2.make_pool(4, 4)
    with pytest.raises(ValueError, match="vocabulary"):
        tp2.forward(pool, [SeqInput([1, 10_000], 0, [0])])
    with pytest.raises(ValueError, match="pages"):
        tp2.forward(pool, [SeqInput(list(range(3, 12)), 0, [0])])
    with pytest.raises(ValueError, match="make_pool"):
        tp2.forward(ModelRunner.make_pool(tp2, 4, 4), [SeqInput([5], 0, [0])])
    # the ranks are still in step: a good forward after the refused ones
    out = tp2.forward(pool, [SeqInput([5, 6, 7], 0, [1])])[0]
    assert out.shape == (3, 256)


def test_on_group_error_is_raised_after_the_forward(tp2):
    pool = tp2.make_pool(8, 4)
    prompt = rm.random_prompt(9, seed=4)

    def boom(a, b):
        raise RuntimeError("transfer failed")

    with pytest.raises(RuntimeError, match="transfer failed"):
        tp2.prefill(pool, prompt, [0, 1, 2], groups=[(0, 1), (1, 4)], on_group=boom)
    ref = tp2.prefill(pool, prompt, [0, 1, 2])  # every rank finished that forward: in step
    assert torch.isfinite(ref).all()


def test_refuses_a_size_that_does_not_split_the_heads():
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size 3 does not divide num_attention_heads 4"
    ):
        load_runner(rm.checkpoint("llama"), device="cpu", tensor_parallel_size=3)


def test_four_ranks_replicate_two_kv_heads():
    """Llama, 4 heads and 2 KV heads on 4 ranks: ranks 0, 1 hold KV head 0, ranks 2, 3 head 1."""
    prompt = rm.random_prompt(9, seed=2)
    expected = rm.hf_greedy("llama", prompt, 16)
    runner = load_runner(rm.checkpoint("llama"), device="cpu", tensor_parallel_size=4)
    try:
        assert runner.plan.kv_heads == (0, 1) and len(runner.worker_pids) == 3
        starts = [x.head_start for x in runner.shard_layouts(runner.make_pool(2, 4))]
        assert starts == [0, 0, 1, 1]
        engine = LLMEngine(runner, runner.make_pool(16, 4), max_batch=2)
        (seq,) = engine.generate([(prompt, SamplingParams(max_tokens=16))])
        assert seq.output_ids == expected
    finally:
        runner.close()


def test_generate_script_with_two_ranks():
    import json
    import os
    import subprocess
    import sys

    root = os.path.join(os.path.dirname(__file__), "..", "..")
    path = rm.checkpoint("qwen2_kv2")
    out = subprocess.run(
        [sys.executable, os.path.join(root, "scripts", "generate.py"), "--model", path]
        + ["--prompt-ids", "5,6,7,8", "--max-tokens", "8", "--tensor-parallel-size", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    (res,) = [json.loads(line) for line in out.stdout.splitlines()]
    assert res["output_ids"] == rm.hf_greedy("qwen2_kv2", [5, 6, 7, 8], 8)


@pytest.mark.parametrize("kind", ["qwen2_kv2", "deepseek_v2"])
def test_torch_fallback_ops_per_rank(kind, monkeypatch):
    """Every rank on torch's ops (SDPA, F.linear, unfused norms and rope): workers inherit the
    settings from rank 0's environment."""
    for name, value in [("ATTENTION", "sdpa"), ("LINEAR", "torch"), ("FUSED", "torch")]:
        monkeypatch.setenv(f"PD_RUNTIME_{name}", value)
    prompt = rm.random_prompt(7, seed=5)
    runner = load_runner(rm.checkpoint(kind), device="cpu", tensor_parallel_size=2)
    try:
        assert runner.model.kernels.attention == "sdpa"
        engine = LLMEngine(runner, runner.make_pool(16, 4), max_batch=2)
        (seq,) = engine.generate([(prompt, SamplingParams(max_tokens=16))])
    finally:
        runner.close()
    assert seq.output_ids == rm.hf_greedy(kind, prompt, 16)


def test_the_sharded_model_refuses_to_run_outside_its_runner(tp2):
    from backends.runtime.spec import self_draft
    from backends.runtime.tp.comm import TensorParallelError

    draft = self_draft(tp2, 2)  # a plain ModelRunner over the shard: workers never hear of it
    pool = draft.make_pool(4, 4)
    with pytest.raises(TensorParallelError, match="not supported yet"):
        draft.forward(pool, [SeqInput([5, 6], 0, [0])])
    out = tp2.forward(tp2.make_pool(4, 4), [SeqInput([5, 6], 0, [0])])[0]  # still in step
    assert out.shape == (2, 256)


@pytest.mark.parametrize("kind", ["qwen2", "deepseek_v3"])
def test_a_rank_reads_only_its_slices_of_the_checkpoint(kind):
    from backends.runtime.tp.rank import load_config, load_shard
    from backends.runtime.tp.shard import ShardPlan, shard_tensors
    from backends.runtime.weights import load_weights

    path = rm.checkpoint(kind)
    cfg = load_config(path, None)
    plan = ShardPlan.build(cfg, 2, 1)
    got = load_shard(path, cfg, plan, "float32", "cpu")
    want = shard_tensors(load_weights(path, cfg.num_layers, torch.float32, "cpu"), cfg, plan)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert got["lm_head.weight"].shape == (128, 64)  # half the vocabulary (tied for qwen2)


def test_an_error_answer_is_raised_and_leaves_the_ranks_in_step(tp2):
    from backends.runtime.tp.comm import TensorParallelError

    pool = tp2.make_pool(4, 4)
    tp2._pool_ids[pool] = 999  # a pool id the worker never made
    with pytest.raises(TensorParallelError, match="no pool 999 on this rank"):
        tp2.shard_layouts(pool)
    good = tp2.make_pool(4, 4)
    assert len(tp2.shard_layouts(good)) == 2  # no stale answer left in the pipe
    assert tp2.forward(good, [SeqInput([5], 0, [0])])[0].shape == (1, 256)
