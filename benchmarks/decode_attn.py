"""The C++ CPU decode-attention kernel (``torch.ops.pd_runtime.paged_decode``) alone, on
SmolLM2's shapes (3 KV heads of 64, 3 query heads each, float32): B sequences of C keys each on
fragmented pages of 16, ``--layers`` distinct layer caches so the keys come from memory as in a
real step. Reports ms per layer (median of ``--reps`` passes over the layers) and the K/V bytes
read per second. ``--baseline-root DIR``: the same in a process of another checkout (its own
kernels), the two taking turns round by round.

    OMP_NUM_THREADS=2 taskset -c 0-1 .venv/bin/python -m benchmarks.decode_attn
    ... --configs 8x512 32x256 --rounds 3 --baseline-root /tmp/base --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from benchmarks import ROOT
from benchmarks.common import emit, median_ms

HKV, GROUP, DIM, PAGE = 3, 3, 64, 16


def measure(root: str, batch: int, ctx: int, layers: int, reps: int) -> float:
    """ms per layer of the kernel in ``root``'s checkout (run in this process, started in
    ``root``: see :func:`run_in`)."""
    import torch

    import backends
    from backends.runtime.cpu_kernels import paged_decode_op

    where = os.path.dirname(os.path.dirname(os.path.abspath(backends.__file__)))
    assert os.path.samefile(where, root), f"measuring {where}, not {root}"

    op = paged_decode_op()
    g = torch.Generator().manual_seed(0)
    pages = batch * (ctx // PAGE)
    slots_n = (pages + 4) * PAGE
    ks = [torch.randn(slots_n, HKV, DIM, generator=g) for _ in range(layers)]
    vs = [torch.randn(slots_n, HKV, DIM, generator=g) for _ in range(layers)]
    table = torch.randperm(pages + 4, generator=g)[:pages].view(batch, -1)
    slots = (table[:, :, None] * PAGE + torch.arange(PAGE)).reshape(batch, -1).contiguous()
    lo, hi = torch.zeros(batch, dtype=torch.long), torch.full((batch,), ctx, dtype=torch.long)
    q = torch.randn(batch, HKV, GROUP, DIM, generator=g)

    def step():
        for k, v in zip(ks, vs, strict=True):
            op(q, k, v, slots, lo, hi, 0.125)

    return median_ms(step, reps) / layers


def run_in(root: str, args, batch: int, ctx: int) -> float:
    """One measurement in a process started in ``root``: ``python -m`` puts the working
    directory first on the path, so ``backends`` is that checkout's (and this package, when
    that checkout has none, comes from the installed project)."""
    cmd = [sys.executable, "-m", "benchmarks.decode_attn", "--measure", root, "--configs"]
    cmd += [f"{batch}x{ctx}", "--layers", str(args.layers), "--reps", str(args.reps)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=root).stdout
    return float(out.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", nargs="+", default=["1x512", "8x512", "32x256"])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline-root", default=None)
    ap.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # one child measurement
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    configs = [tuple(int(n) for n in c.split("x")) for c in args.configs]
    if args.measure:
        print(measure(args.measure, *configs[0], args.layers, args.reps))
        return 0
    roots = {"this": str(ROOT)}
    if args.baseline_root:
        roots["baseline"] = args.baseline_root
    results = []
    for batch, ctx in configs:
        times = {name: [] for name in roots}
        for r in range(args.rounds):
            for name in list(roots) if r % 2 == 0 else list(roots)[::-1]:
                times[name].append(run_in(roots[name], args, batch, ctx))
        gb = batch * ctx * HKV * DIM * 4 * 2 / 1e9  # K and V bytes one layer reads
        row = {"config": f"{batch}x{ctx}", "ms_per_layer": {}, "gb_s": {}, "runs": times}
        for name, ts in times.items():
            ms = statistics.median(ts)
            row["ms_per_layer"][name] = round(ms, 4)
            row["gb_s"][name] = round(gb / ms * 1e3, 1)
        results.append(row)
        print(f"[bench] {json.dumps(row)}", file=sys.stderr, flush=True)
    header = ["config", *(f"{n} ms/layer (GB/s)" for n in roots)]
    rows = [
        [r["config"], *(f"{r['ms_per_layer'][n]:.3f} ({r['gb_s'][n]})" for n in roots)]
        for r in results
    ]
    out = {"threads": os.environ.get("OMP_NUM_THREADS"), "results": results}
    emit(out, args.json, header, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
