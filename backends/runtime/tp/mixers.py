"""Tensor-parallel slices of the recurrent mixers (gated DeltaNet, Mamba2): by head GROUP.

A state slot's sub-blocks split into ``G = StateSpec.groups`` equal groups of heads (the gcd of
their head counts, :mod:`backends.runtime.state_pool`), and rank ``r`` of ``N`` holds groups
``[r G/N, (r+1) G/N)`` of every one (``ShardPlan.groups``). Its weights follow: every tensor of
a mixer is cut to the channels of those groups, so the rank runs the unchanged mixer over a
config of ``1/N`` of the heads (``ShardPlan.local_config``) and its state slot is exactly its
groups of the whole slot, sub-block by sub-block (what moves between TP sizes).

Gated DeltaNet (``linear_attn``; ``Hk`` key heads of ``dk``, ``Hv = r Hk`` value heads of
``dv``; a group: ``Hk / G`` key heads and the ``Hv / G`` value heads they serve)::

    in_proj_qkvz [Hk (2 dk + 2 r dv), D]  Qwen3-Next: per key head [q | k | v | z]: its rows
    in_proj_ba   [Hk 2 r, D]              per key head [b | a]: its rows
    in_proj_qkv  [2 Hk dk + Hv dv, D]     Qwen3.5: [q | k | v] blocks: three runs of rows
    in_proj_z    [Hv dv, D]; in_proj_b, in_proj_a [Hv, D]: value-head rows
    conv1d       [2 Hk dk + Hv dv, 1, K]  channels [q | k | v]: three runs (its bias alike)
    A_log, dt_bias [Hv]: per value head;  norm [dv]: replicated (shared by the heads)
    out_proj     [D, Hv dv]               row-parallel: value-head columns (a bias on rank 0)

Mamba2 (``mixer`` in Nemotron-H, ``mamba`` in Granite 4.0-H; ``H`` heads of ``P`` channels,
``n_groups`` groups of ``N`` for B and C; a state group: ``H / G`` heads and
``n_groups / G`` B/C groups)::

    in_proj  [H P + (H P + 2 n_groups N) + H, D]  [z | x | B | C | dt]: five runs of rows
    conv1d   [H P + 2 n_groups N, 1, K]           channels [x | B | C]: three runs
    A_log, D, dt_bias [H]: per head;  norm [H P]: per head (its gated RMSNorm is per B/C group)
    out_proj [D, H P]                             row-parallel: head columns

A rank's runs are concatenated in this order, which is the order of the whole tensor's blocks,
so the local mixer's ``split`` of its projection finds each block where it looks for it.
"""

from __future__ import annotations

import re

from ..config import ModelConfig

ALL = "all"  # every rank holds all of it (shard.ALL)

_DELTANET = re.compile(
    r"\.linear_attn\.(in_proj_qkvz|in_proj_ba|in_proj_qkv|in_proj_z|in_proj_b|in_proj_a"
    r"|conv1d|out_proj|A_log|dt_bias|norm)(?:\.(weight|bias))?$"
)
_MAMBA = re.compile(
    r"\.(?:mixer|mamba)\.(in_proj|conv1d|out_proj|A_log|D|dt_bias|norm)(?:\.(weight|bias))?$"
)


def mixer_part(name: str, cfg: ModelConfig) -> tuple[str, bool] | None:
    """(tensor, whether a bias) when ``name`` is a recurrent mixer's tensor of ``cfg``'s family;
    None otherwise (Nemotron-H's attention ``mixer.q_proj`` is not: attention's rules)."""
    pattern = _DELTANET if cfg.deltanet else _MAMBA if cfg.mamba else None
    m = pattern.search(name) if pattern is not None else None
    return None if m is None else (m.group(1), m.group(2) == "bias")


def mixer_spec(part: tuple[str, bool], cfg: ModelConfig, groups: tuple[int, int], total: int):
    """What the rank holding state groups ``groups`` (of ``total``) holds of mixer tensor
    ``part`` (:func:`mixer_part`): ``ALL``, a slice ``(dim, ranges)``, or None (a row-parallel
    bias, held by rank 0 only and added once to the sum)."""
    tensor, bias = part
    if tensor == "out_proj" and bias:
        return ALL if groups[0] == 0 else None
    if cfg.deltanet:
        return _deltanet_spec(tensor, cfg, groups, total)
    return _mamba_spec(tensor, cfg, groups, total)


def _of(groups: tuple[int, int], total: int, n: int) -> tuple[int, int]:
    """The range of ``n`` heads (a multiple of ``total``) that groups ``[g0, g1)`` hold."""
    return groups[0] * n // total, groups[1] * n // total


def _deltanet_spec(tensor: str, cfg: ModelConfig, groups: tuple[int, int], total: int):
    c = cfg.deltanet
    (k0, k1), (v0, v1) = _of(groups, total, c.num_k_heads), _of(groups, total, c.num_v_heads)
    dk, dv, r = c.k_head_dim, c.v_head_dim, c.num_v_heads // c.num_k_heads
    qk = c.num_k_heads * dk  # q's (and k's) channels of the whole layer
    if tensor == "in_proj_qkvz":  # per key head [q | k | v | z]
        per = 2 * dk + 2 * r * dv
        return 0, ((k0 * per, k1 * per),)
    if tensor == "in_proj_ba":  # per key head [b | a]
        return 0, ((k0 * 2 * r, k1 * 2 * r),)
    if tensor in ("in_proj_qkv", "conv1d"):  # [q | k | v] blocks
        return 0, (
            (k0 * dk, k1 * dk),
            (qk + k0 * dk, qk + k1 * dk),
            (2 * qk + v0 * dv, 2 * qk + v1 * dv),
        )
    if tensor in ("in_proj_z", "out_proj"):  # value-head channels: rows; out_proj's columns
        return (1 if tensor == "out_proj" else 0), ((v0 * dv, v1 * dv),)
    if tensor in ("in_proj_b", "in_proj_a", "A_log", "dt_bias"):
        return 0, ((v0, v1),)
    return ALL  # norm: [dv], one weight for every head


def _mamba_spec(tensor: str, cfg: ModelConfig, groups: tuple[int, int], total: int):
    c = cfg.mamba
    H, P, N = c.num_heads, c.head_dim, c.state_size
    (h0, h1), (b0, b1) = _of(groups, total, H), _of(groups, total, c.n_groups)
    blocks = {  # letter: (the whole block's size, this rank's [first, end) inside it)
        "z": (H * P, h0 * P, h1 * P),
        "x": (H * P, h0 * P, h1 * P),
        "B": (c.n_groups * N, b0 * N, b1 * N),
        "C": (c.n_groups * N, b0 * N, b1 * N),
        "d": (H, h0, h1),  # dt, and every per-head vector
    }
    letters = {"in_proj": "zxBCd", "conv1d": "xBC", "norm": "x", "out_proj": "x"}.get(tensor, "d")
    runs, offset = [], 0
    for letter in letters:  # blocks back to back: each run at its block's offset
        size, a, b = blocks[letter]
        runs.append((offset + a, offset + b))
        offset += size
    return (1 if tensor == "out_proj" else 0), tuple(runs)
