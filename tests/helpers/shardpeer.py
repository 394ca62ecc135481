"""Test harness: one TP rank's KV shards (:class:`kvtransfer.tp.shards.RankShards`) in its own OS
process with its own Mooncake engine, driven through ``PeerProcess("shards", ...)``. One peer
holds several named shard sets (one per test case) on one engine, so a test module spawns its
ranks once."""

from __future__ import annotations

import numpy as np
import torch

from kvtransfer import EntryLayout, TransferConfig
from kvtransfer.link.engine import Engine
from kvtransfer.memory.layout import ShardPiece
from kvtransfer.tp.shards import RankShards

SLOTS, SLOT_BYTES = 2, 8192
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class ShardPeer:
    def __init__(self, side: str, entries: dict, config: dict, seed: int = 0, device="cpu"):
        self.engine = Engine(TransferConfig(**config))
        self.seed, self.device = seed, device
        self.sets: dict[str, RankShards] = {}
        self.tensors: dict[str, dict[str, torch.Tensor]] = {}

    def info(self) -> dict:
        return {"session": self.engine.session_id}

    def make(self, name: str, entries: dict[str, dict], fill: bool) -> list[int]:
        """Shards ``name``: role -> EntryLayout kwargs (with num_pages); random bytes (a prefill
        rank) or -1 everywhere (a decode rank). Returns its slots' addresses."""
        g = torch.Generator().manual_seed(self.seed + len(self.sets))
        tensors, layouts = {}, {}
        for role, kw in entries.items():
            lay = EntryLayout(role=role, **kw)
            dt = DTYPES[lay.dtype]
            t = (torch.randn(lay.buffer_shape(), generator=g).to(dt) if fill
                 else torch.full(lay.buffer_shape(), -1.0, dtype=dt)).to(self.device)  # fmt: skip
            tensors[role], layouts[role] = t, lay.with_pool(lay.num_pages, t.data_ptr())
        self.sets[name] = RankShards(self.engine, tensors, layouts, SLOTS, SLOT_BYTES)
        self.tensors[name] = tensors
        return [self.sets[name].slot_addr(s) for s in range(SLOTS)]

    def send(self, name, piece, pages, layers, chunk, slot, session, remote_addr) -> bool:
        return self.sets[name].send(ShardPiece(*piece), pages, range(*layers), tuple(chunk),
                                    slot, session, remote_addr)  # fmt: skip

    def receive(self, name, piece, pages, layers, chunk, slot) -> None:
        self.sets[name].receive(ShardPiece(*piece), pages, range(*layers), tuple(chunk), slot)

    def buffer(self, name: str, role: str) -> np.ndarray:
        """The shard's values as float32 (exact for bfloat16)."""
        return self.tensors[name][role].float().cpu().numpy()

    def close(self) -> None:
        self.engine.close()
