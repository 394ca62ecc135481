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
    assert (mk.num_pages, mk.page_size, mk.role, mk.num_slots) == (16, 8, "draft", None)
    mk = decode(encode(Command(MAKE_POOL, 2, 16, 8, num_slots=6, state_id=5)))
    assert (mk.num_slots, mk.state_id) == (6, 5)
    # a hybrid's sequences carry their state slot (after window pages, None where there are none)
    slots = [([5, 6], 0, [7], None, 3), ([9], 12, [1, 4], [0, 4], 0), ([8], 3, [2])]
    assert decode(encode(Command(PREFILL, 1, seqs=slots))).seqs == slots
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


def _hybrid(kind: str) -> ModelConfig:
    import runtime_models as rm

    return ModelConfig.from_pretrained(rm.checkpoint(kind))


def _arange_rows(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32)[:, None]  # [n, 1]: row i holds i


def _rows(t: torch.Tensor) -> list[int]:
    return t[:, 0].long().tolist()


def test_a_hybrid_splits_its_state_groups_and_refuses_sizes_that_do_not():
    cfg = _hybrid("qwen3_next")  # DeltaNet: 2 key heads, 4 value heads -> 2 groups
    plans = [ShardPlan.build(cfg, 2, r) for r in range(2)]
    assert [(p.groups, p.total_groups) for p in plans] == [((0, 1), 2), ((1, 2), 2)]
    local = plans[1].local_config(cfg).deltanet
    assert (local.num_k_heads, local.num_v_heads, local.k_head_dim) == (1, 2, 8)
    assert ShardPlan.build(gqa(4, 2), 2, 0).total_groups == 0  # no recurrent layers
    with pytest.raises(TensorParallelConfigError) as e:
        ShardPlan.build(cfg, 4, 0)  # 4 attention heads split, 2 state groups do not
    assert "tensor_parallel_size 4 does not divide the 2 head groups" in str(e.value)
    assert "conv_q 2, conv_k 2, conv_v 4, recurrent 4" in str(e.value)
    assert "sizes that work: [1, 2]" in str(e.value)
    mamba = ShardPlan.build(_hybrid("nemotron_h"), 2, 1).local_config(_hybrid("nemotron_h"))
    assert (mamba.mamba.num_heads, mamba.mamba.n_groups, mamba.num_heads) == (2, 1, 2)


def test_recurrent_projections_split_each_fused_block_on_its_own():
    """Row ``i`` of each tensor holds ``i``: a rank's rows name which channels it got."""
    nem = _hybrid("nemotron_h")  # Mamba2: 4 heads of 16, 2 B/C groups of 16
    p = "model.layers.0.mixer"
    full = {
        f"{p}.in_proj.weight": _arange_rows(64 + 64 + 32 + 32 + 4),  # [z | x | B | C | dt]
        f"{p}.conv1d.weight": _arange_rows(128),  # [x | B | C]
        f"{p}.out_proj.weight": _arange_rows(64).T,
        f"{p}.A_log": torch.arange(4.0),
        "lm_head.weight": torch.ones(256, 1),
    }
    r1 = shard_tensors(full, nem, ShardPlan.build(nem, 2, 1))
    z, x = list(range(32, 64)), list(range(64 + 32, 128))
    B, C, dt = list(range(128 + 16, 160)), list(range(160 + 16, 192)), [194, 195]
    assert _rows(r1[f"{p}.in_proj.weight"]) == z + x + B + C + dt
    assert _rows(r1[f"{p}.conv1d.weight"]) == [i - 64 for i in x + B + C]
    assert _rows(r1[f"{p}.out_proj.weight"].T) == list(range(32, 64))
    assert r1[f"{p}.A_log"].tolist() == [2.0, 3.0]
    q35 = _hybrid("qwen3_5")  # DeltaNet: q, k 2 heads of 8, v 4 heads of 16
    p = "model.layers.0.linear_attn"
    full = {f"{p}.in_proj_qkv.weight": _arange_rows(96), f"{p}.in_proj_b.weight": _arange_rows(4)}
    full["lm_head.weight"] = torch.ones(256, 1)
    r1 = shard_tensors(full, q35, ShardPlan.build(q35, 2, 1))
    q, k, v = list(range(8, 16)), list(range(24, 32)), list(range(64, 96))
    assert _rows(r1[f"{p}.in_proj_qkv.weight"]) == q + k + v
    assert _rows(r1[f"{p}.in_proj_b.weight"]) == [2, 3]
    q3n = _hybrid("qwen3_next")  # per key head [q 8 | k 8 | v 32 | z 32] and [b 2 | a 2]
    full = {
        f"{p}.in_proj_qkvz.weight": _arange_rows(160),
        f"{p}.in_proj_ba.weight": _arange_rows(8),
    }
    full["lm_head.weight"] = torch.ones(256, 1)
    r1 = shard_tensors(full, q3n, ShardPlan.build(q3n, 2, 1))
    assert _rows(r1[f"{p}.in_proj_qkvz.weight"]) == list(range(80, 160))
    assert _rows(r1[f"{p}.in_proj_ba.weight"]) == [4, 5, 6, 7]
