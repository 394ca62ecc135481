"""A state entry split between tensor-parallel sizes (kvtransfer.memory.layout.state_runs and
staging): every sub-block of a slot splits into head groups alike, a rank holds the same groups
of each; a head slice gathered from one shard and scattered into another lands in each
sub-block's groups, nothing else, for every pairing the handshake finds (2 -> 1, 1 -> 2, 2 -> 4)."""

from __future__ import annotations

import pytest
import torch

from kvtransfer.memory.layout import EntryLayout, shard_pieces, staging_rows, state_runs
from kvtransfer.memory.staging import StagingArea

GROUPS = 4
# a DeltaNet-like slot per group: conv q (1 head x 6), conv k (1 x 6), conv v (2 x 5), state (2 x 7)
SEGMENTS = ((1, 6), (1, 6), (2, 5), (2, 7))
PER_GROUP = sum(h * e for h, e in SEGMENTS)
SLOTS, LAYERS = 3, 2


def shard(first: int, count: int) -> EntryLayout:
    return EntryLayout(role="target.state", attn="state", dtype="float32", page_size=1,
                       num_layers=LAYERS, num_pages=SLOTS, kv_heads=count, head_start=first,
                       total_kv_heads=GROUPS, head_dim=PER_GROUP, segments=SEGMENTS)  # fmt: skip


def full_state(seed: int) -> torch.Tensor:
    """[layers, slots, sub-blocks of every group], distinct values."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS, SLOTS, GROUPS * PER_GROUP, generator=g)


def of_groups(t: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """The rank slot of groups [first, first + count) cut out of a full (TP 1) slot tensor."""
    full = shard(0, GROUPS)
    parts = [t[..., a : a + n] for a, n in state_runs(full, first, count)]
    return torch.cat(parts, dim=-1)


class Rank:
    def __init__(self, first: int, count: int, t: torch.Tensor):
        self.lay0, self.t = shard(first, count), t.contiguous().clone()
        self.lay = self.lay0.with_pool(SLOTS, self.t.data_ptr())
        self.area = StagingArea({"target.state": self.t}, {"target.state": self.lay}, 1, 4096)


def test_state_runs_are_each_sub_block_s_groups():
    lay = shard(0, GROUPS)
    assert state_runs(lay, 1, 2) == [(6, 12), (24 + 6, 12), (48 + 10, 20), (88 + 14, 28)]
    with pytest.raises(IndexError):
        state_runs(lay, 3, 2)


@pytest.mark.parametrize("prefill, decode", [(2, 1), (1, 2), (2, 4), (4, 2)])
def test_a_state_moves_between_tp_sizes_group_by_group(prefill, decode):
    full = full_state(seed=prefill * 10 + decode)
    n_src, n_dst = GROUPS // prefill, GROUPS // decode
    src = [Rank(r * n_src, n_src, of_groups(full, r * n_src, n_src)) for r in range(prefill)]
    dst = [Rank(r * n_dst, n_dst, torch.full_like(of_groups(full, 0, n_dst), -1.0))
           for r in range(decode)]  # fmt: skip
    pieces = shard_pieces([r.lay for r in src], [r.lay for r in dst])
    src_slot, dst_slot, layers = 2, 0, range(0, LAYERS)  # the room's slot on each side
    for p in pieces:
        s, d = src[p.src], dst[p.dst]
        rows = staging_rows(s.lay, [src_slot], layers, 0, LAYERS)
        s.area.gather("target.state", rows, 0, heads=(p.src_off, p.heads))
        d.area.buffer.copy_(s.area.buffer)  # what the one Mooncake write of the slot does
        d.area.scatter("target.state", staging_rows(d.lay, [dst_slot], layers, 0, LAYERS), 0,
                       heads=(p.dst_off, p.heads))  # fmt: skip
    for r, d in enumerate(dst):
        want = of_groups(full, r * n_dst, n_dst)[:, src_slot]
        torch.testing.assert_close(d.t[:, dst_slot], want, rtol=0, atol=0)
        assert (d.t[:, [s for s in range(SLOTS) if s != dst_slot]] == -1).all()  # nothing else
