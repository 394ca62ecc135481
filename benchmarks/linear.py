"""Linear layers at decode and prefill row counts: the runtime's C++ small-row kernel against
oneDNN with pre-packed weights and torch's ``F.linear`` (MKL), on one model's shapes.

Each measurement runs every layer's projections (q/k/v, o, gate/up, down; ``--layers`` distinct
weights, so they come from memory, not cache, as in a real step), plus the LM head at decode
sizes (up to ``SMALL_ROWS`` rows; a prefill runs the head on each prompt's last row only), and
reports the median of ``--reps`` passes in ms. A path that does not apply prints ``-``.

    OMP_NUM_THREADS=2 taskset -c 0-1 .venv/bin/python -m benchmarks.linear
    ... --rows 1 8 32 --dtype bfloat16 --json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from backends.runtime.cpu_kernels import cpu_ops
from backends.runtime.kernels import SMALL_ROWS
from benchmarks.common import median_ms

# SmolLM2-135M: hidden 576, 9 query and 3 KV heads of 64, MLP 1536, vocabulary 49152
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
HEAD = (49152, 576)


def paths(dtype: torch.dtype, rows: int) -> dict:
    """name -> fn(x, w, packed) for the paths that apply at this dtype and row count."""
    out = {}
    ops = cpu_ops()
    if ops is not None and rows <= SMALL_ROWS:
        out["small-row kernel"] = lambda x, w, p: ops.linear_small(x, w, None)
    if dtype == torch.float32 and torch.backends.mkldnn.is_available():
        out["oneDNN packed"] = lambda x, w, p: torch.ops.mkldnn._linear_pointwise(
            x, p, None, "none", [], ""
        )
    out["F.linear"] = lambda x, w, p: F.linear(x, w)
    if dtype in (torch.bfloat16, torch.float16):
        out["F.linear widened"] = lambda x, w, p: F.linear(x.float(), w.float()).to(dtype)
    return out


def measure(rows: int, dtype: torch.dtype, layers: int, reps: int) -> dict:
    g = torch.Generator().manual_seed(rows)
    totals: dict[str, float] = {}
    shapes = [*SHAPES.items(), ("lm_head", HEAD)] if rows <= SMALL_ROWS else SHAPES.items()
    for name, (n, k) in shapes:
        count = 1 if name == "lm_head" else layers
        ws = [torch.randn(n, k, generator=g).to(dtype) for _ in range(count)]
        packed = [None] * count
        if dtype == torch.float32 and torch.backends.mkldnn.is_available():
            packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in ws]
        x = torch.randn(rows, k, generator=g).to(dtype)
        for path, fn in paths(dtype, rows).items():

            def run(fn=fn, x=x, ws=ws, packed=packed):
                return [fn(x, w, p) for w, p in zip(ws, packed, strict=True)]

            totals[path] = totals.get(path, 0.0) + median_ms(run, reps)
    return {"rows": rows, "dtype": str(dtype).split(".")[-1], "layers": layers, "ms": totals}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 8, 32, 64, 512])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--layers", type=int, default=30, help="distinct weights per projection")
    ap.add_argument("--big-layers", type=int, default=30, help="layers above SMALL_ROWS rows")
    ap.add_argument("--reps", type=int, default=5, help="(3 above SMALL_ROWS rows)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    results = []
    for rows in args.rows:
        layers = args.layers if rows <= SMALL_ROWS else args.big_layers
        reps = args.reps if rows <= SMALL_ROWS else min(args.reps, 3)
        results.append(measure(rows, dtype, layers, reps))
        print(f"[linear] {json.dumps(results[-1])}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"threads": torch.get_num_threads(), "results": results}))
        return 0
    names = sorted({p for r in results for p in r["ms"]})
    print(f"| rows ({args.dtype}, layers) | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for r in results:
        cells = [f"{r['ms'][n]:.1f}" if n in r["ms"] else "-" for n in names]
        print(f"| {r['rows']} ({r['layers']}) | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
