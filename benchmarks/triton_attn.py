"""The Triton paged-attention kernel against torch's SDPA on CUDA: causal prefill of one prompt
over fragmented pages (SDPA reads the same keys gathered into contiguous rows first, which it is
not timed for), relative error against a float32 SDPA, median times and TFLOP/s. Needs a GPU.

    .venv/bin/python -m benchmarks.triton_attn --json
    .venv/bin/python -m benchmarks.triton_attn --block-n 32   # the kernel with another key tile
"""

from __future__ import annotations

import argparse
import sys

import torch

from backends.runtime import triton_attn as ta
from benchmarks.common import emit

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def case(T: int, H: int, Hkv: int, D: int, dtype: torch.dtype, page_size: int) -> dict:
    import triton

    g = torch.Generator(device="cuda").manual_seed(0)
    pages = -(-T // page_size)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=g)

    k, v, q = randn(pages * page_size, Hkv, D), randn(pages * page_size, Hkv, D), randn(T, H, D)
    table = torch.randperm(pages, device="cuda", generator=g).to(torch.int32)[None]
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    starts = torch.zeros(1, dtype=torch.int32, device="cuda")

    def kernel():
        return ta.paged_attention(q, k, v, table, cu, starts, T, page_size, D**-0.5, max_ctx=T)

    def rows(x):  # the prompt's keys in order, [1, H, T, D]
        x = x.view(pages, page_size, Hkv, D)[table[0].long()].reshape(-1, Hkv, D)[:T]
        return x.transpose(0, 1)[None].repeat_interleave(H // Hkv, 1)

    kq, vq, qq = rows(k), rows(v), q.transpose(0, 1)[None]

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(qq, kq, vq, is_causal=True)

    ref = torch.nn.functional.scaled_dot_product_attention(
        qq.float(), kq.float(), vq.float(), is_causal=True
    )[0].transpose(0, 1)
    err = lambda out: float((out.float() - ref).norm() / ref.norm())  # noqa: E731
    flops = 4 * H * D * T * T / 2  # causal: half the score matrix
    row = {"tokens": T, "heads": H, "kv_heads": Hkv, "head_dim": D, "dtype": str(dtype)[6:]}
    for name, fn, out in (("triton", kernel, kernel()), ("sdpa", sdpa, sdpa()[0].transpose(0, 1))):
        ms = triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")
        row[name] = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1), "rel_err": err(out)}
    row["triton_over_sdpa"] = round(row["sdpa"]["ms"] / row["triton"]["ms"], 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--shapes", nargs="+", default=["32x8x128", "9x3x64"], help="HxHKVxD")
    ap.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"], choices=DTYPES)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--block-n", type=int, help="the kernel's key tile (default: its own)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks.triton_attn needs a CUDA GPU")
    if args.block_n:
        tiles = ta._tiles
        ta._tiles = lambda *a: (*tiles(*a)[:3], args.block_n)
    rows = [
        case(T, *map(int, shape.split("x")), DTYPES[dt], args.page_size)
        for shape in args.shapes for dt in args.dtypes for T in args.tokens
    ]  # fmt: skip
    out = {"device": torch.cuda.get_device_name(), "block_n": args.block_n, "rows": rows}
    header = ["tokens", "H/Hkv x D", "dtype", "triton ms", "TFLOP/s", "sdpa ms", "TFLOP/s", "ratio"]
    emit(out, args.json, header, [
        [r["tokens"], f"{r['heads']}/{r['kv_heads']} x {r['head_dim']}", r["dtype"],
         r["triton"]["ms"], r["triton"]["tflops"], r["sdpa"]["ms"], r["sdpa"]["tflops"],
         r["triton_over_sdpa"]] for r in rows
    ])  # fmt: skip


if __name__ == "__main__":
    main()
