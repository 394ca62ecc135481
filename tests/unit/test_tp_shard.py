"""Tensor-parallel sharding plans and the command wire format (no processes)."""

from __future__ import annotations

import pytest
import torch

from backends.runtime.config import ModelConfig
from backends.runtime.tp.shard import ShardPlan, TensorParallelConfigError, shard_tensors
from backends.runtime.tp.wire import FORWARD, MAKE_POOL, PREFILL, Command, decode, encode


def gqa(heads: int, kv: int, vocab: int = 10) -> ModelConfig:
    return ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": vocab,
            "hidden_size": 4 * heads,
            "num_hidden_layers": 1,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "intermediate_size": 10,
        }
    )


def test_smollm2_shapes_split_at_3_and_refuse_2():
    cfg = gqa(9, 3, vocab=49152)
    plans = [ShardPlan.build(cfg, 3, r) for r in range(3)]
    assert [p.heads for p in plans] == [(0, 3), (3, 6), (6, 9)]
    assert [p.kv_heads for p in plans] == [(0, 1), (1, 2), (2, 3)]
    assert [p.vocab for p in plans] == [(0, 16384), (16384, 32768), (32768, 49152)]
    with pytest.raises(TensorParallelConfigError) as e:
        ShardPlan.build(cfg, 2, 0)
    assert "tensor_parallel_size 2 does not divide num_attention_heads 9" in str(e.value)
    assert "[1, 3, 9]" in str(e.value)
    nine = [ShardPlan.build(cfg, 9, r).kv_heads for r in range(9)]  # each KV head on 3 ranks
    assert nine == [(0, 1)] * 3 + [(1, 2)] * 3 + [(2, 3)] * 3


def test_kv_heads_that_neither_divide_nor_are_divided_are_refused():
    with pytest.raises(TensorParallelConfigError, match="num_key_value_heads 3"):
        ShardPlan.build(gqa(6, 3), 2, 0)


def test_shards_put_back_together_are_the_checkpoint():
    cfg = gqa(4, 2, vocab=11)  # vocab 11 over 2 ranks: 6 rows each, one zero pad row
    D, hd = cfg.hidden_size, cfg.head_dim
    g = torch.Generator().manual_seed(0)
    full = {
        "model.embed_tokens.weight": torch.randn(11, D, generator=g),
        "lm_head.weight": torch.randn(11, D, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(4 * hd, D, generator=g),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(2 * hd, D, generator=g),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(D, 4 * hd, generator=g),
        "model.layers.0.self_attn.o_proj.bias": torch.randn(D, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(10, D, generator=g),
        "model.layers.0.mlp.down_proj.weight": torch.randn(D, 10, generator=g),
        "model.layers.0.input_layernorm.weight": torch.randn(D, generator=g),
    }
    shards = [shard_tensors(full, cfg, ShardPlan.build(cfg, 2, r)) for r in range(2)]
    for name, dim in [("q_proj.weight", 0), ("k_proj.weight", 0), ("o_proj.weight", 1)]:
        n = f"model.layers.0.self_attn.{name}"
        assert torch.equal(torch.cat([s[n] for s in shards], dim), full[n])
    for name, dim in [("up_proj.weight", 0), ("down_proj.weight", 1)]:
        n = f"model.layers.0.mlp.{name}"
        assert torch.equal(torch.cat([s[n] for s in shards], dim), full[n])
    head = torch.cat([s["lm_head.weight"] for s in shards])  # [12, D]
    assert torch.equal(head[:11], full["lm_head.weight"]) and not head[11].any()
    assert "model.layers.0.self_attn.o_proj.bias" not in shards[1]  # added once, on rank 0
    assert torch.equal(
        shards[1]["model.layers.0.input_layernorm.weight"],
        full["model.layers.0.input_layernorm.weight"],
    )


def test_commands_round_trip():
    fwd = Command(FORWARD, 3, last_only=True, seqs=[([5, 6], 0, [7]), ([9], 12, [1, 4, 2, 8])])
    got = decode(encode(fwd))
    assert (got.op, got.pool_id, got.last_only, got.seqs) == (FORWARD, 3, True, fwd.seqs)
    pre = decode(encode(Command(PREFILL, 1, seqs=[([1, 2, 3], 4, [0, 2])])))
    assert pre.seqs == [([1, 2, 3], 4, [0, 2])]
    mk = decode(encode(Command(MAKE_POOL, 2, num_pages=16, page_size=8, role="draft")))
    assert (mk.num_pages, mk.page_size, mk.role) == (16, 8, "draft")
    with pytest.raises(ValueError, match="version"):
        decode(b"\x07" + encode(fwd)[1:])


def test_fused_expert_tensors_split_each_expert_intermediate():
    cfg = gqa(4, 2)
    E, inter, D = 3, 6, 5
    gate_up = torch.arange(E * 2 * inter * D, dtype=torch.float32).view(E, 2 * inter, D)
    down = torch.arange(E * D * inter, dtype=torch.float32).view(E, D, inter)
    full = {"model.layers.0.mlp.experts.gate_up_proj": gate_up, "lm_head.weight": torch.ones(10, D)}
    full["model.layers.0.mlp.experts.down_proj"] = down
    shards = [shard_tensors(full, cfg, ShardPlan.build(cfg, 2, r)) for r in range(2)]
    parts = [s["model.layers.0.mlp.experts.gate_up_proj"] for s in shards]  # [E, 2 * 3, D] each
    assert torch.equal(torch.cat([p[:, :3] for p in parts], 1), gate_up[:, :inter])  # gate
    assert torch.equal(torch.cat([p[:, 3:] for p in parts], 1), gate_up[:, inter:])  # up
    downs = [s["model.layers.0.mlp.experts.down_proj"] for s in shards]
    assert torch.equal(torch.cat(downs, 2), down)


@pytest.mark.parametrize("size", [0, -1, 2.0])
def test_sizes_that_are_not_positive_integers_are_refused(size):
    from backends.runtime.tp.runner import tp_devices

    with pytest.raises(TensorParallelConfigError, match=f"got {size!r}"):
        tp_devices("cpu", size)
