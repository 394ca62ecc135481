"""kv_checksum's sums (kvtransfer/protocol/checksum.py): position-wise over the page list, equal on
both sides for the same bytes whatever the page ids, the GPU path (gather) equal to the CPU path,
and a flipped bit named by entry and layer."""

import random

import torch

from kvtransfer import EntryLayout
from kvtransfer.protocol import checksum as c


def pool(attn="gqa", pages=20, seed=0):
    kw = (
        dict(kv_heads=2, head_dim=8)
        if attn == "gqa"
        else dict(head_dim=12, kv_lora_rank=8, rope_dim=4)
    )
    lay = EntryLayout(role="target", attn=attn, dtype="float32", page_size=4, num_layers=3,
                      num_pages=pages, **kw)  # fmt: skip
    t = torch.randn(lay.nbytes // 4, generator=torch.Generator().manual_seed(seed))
    return lay.with_pool(pages, t.data_ptr()), t


def test_same_bytes_other_pages_same_sums_and_gather_path_agrees():
    for attn in ("gqa", "mla"):
        src, ts = pool(attn)
        dst, td = pool(attn, seed=1)
        sp, dp = random.Random(0).sample(range(20), 7), random.Random(1).sample(range(20), 7)
        rows_s, rows_d = ts.view(torch.uint8).view(-1, src.page_bytes), td.view(torch.uint8)
        rows_d = rows_d.view(-1, dst.page_bytes)
        for layer in range(3):  # copy the room's pages as a transfer would
            for comp in range(src.components):
                base = (layer * src.components + comp) * 20
                rows_d[[base + p for p in dp]] = rows_s[[base + p for p in sp]]
        sums = c.entry_checksums(src, ts, sp)
        assert sums == c.entry_checksums(dst, td, dp)
        assert sums == c.sums_gathered(src, ts.view(torch.uint8).reshape(-1), sp)
        assert (
            c.verify_room({"target": dst}, {"target": td}, {"target": dp}, {"target": sums}) is None
        )
        c.flip_one_byte(dst, td, dp)
        bad = c.verify_room({"target": dst}, {"target": td}, {"target": dp}, {"target": sums})
        assert bad.startswith("KV checksum mismatch: target layer 0 (prefill ")
