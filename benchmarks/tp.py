"""Tensor-parallel step time against one rank: a decode step (B sequences, one token each, after a
prompt of ``--context`` tokens) and a prefill, median of ``--reps`` in ms, per ``--sizes``.

Each size runs in the same process one after the other; rank 0 and every worker get
``cores // size`` torch threads (at least 1), as ``scripts/generate.py`` gives them.

    .venv/bin/python -m benchmarks.tp --sizes 1 3 --batch 1 8 --json  # one object, a row a size
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from backends.runtime.loader import load_runner
from backends.runtime.paged import SeqInput
from benchmarks.common import command_line, log, median_ms


def bench(args, size: int) -> dict:
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    runner = load_runner(args.model, dtype=args.dtype, tensor_parallel_size=size)
    try:
        out = {"tp": size}
        page = 16
        per_seq = -(-(args.context + 1) // page)
        pool = runner.make_pool(per_seq * max(args.batch), page)
        prompt = [(7 * i) % 1000 + 10 for i in range(args.context)]
        tables = [pool.alloc(per_seq) for _ in range(max(args.batch))]
        out["prefill_ms"] = median_ms(lambda: runner.prefill(pool, prompt, tables[0]), args.reps)
        for t in tables[1:]:
            runner.prefill(pool, prompt, t)
        for b in args.batch:
            seqs = [SeqInput([11], args.context, t) for t in tables[:b]]
            out[f"decode_b{b}_ms"] = median_ms(lambda s=seqs: runner.forward(pool, s), args.reps)
        return out
    finally:
        runner.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    for size in args.sizes:
        rows.append(bench(args, size))
        log("  ".join(f"{k}={v:.1f}" for k, v in rows[-1].items()))
    if args.json:
        meta = {
            "command": command_line("benchmarks.tp", argv),
            "cpus": os.cpu_count(),
            "load_avg": os.getloadavg(),
            "context": args.context,
            "reps": args.reps,
        }
        print(json.dumps({"meta": meta, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
