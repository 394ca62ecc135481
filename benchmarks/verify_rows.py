"""The target's verify forward of W draft chains of k drafts (``spec_branches``), in the two
layouts it can take, timed in turn in one process:

* ``separate``: each chain an input of its own over ``[last token, chain]``: W (k + 1) rows;
* ``rooted``: the first chain over ``[last token, chain]``, every other over its chain alone,
  rooted at the first (``SeqInput.root``: the last token's KV is computed once and copied into
  the chain's pages): 1 + W k rows. What decode runs.

Each pass feeds the same tokens over a context of ``--context`` tokens already in the pool, with
features, as decode's verify does; the layouts alternate pass by pass. Reports per W the median,
p99, min and max of ``--reps`` passes in ms, and the ms a row saved.

    .venv/bin/python -m benchmarks.verify_rows --branches 1 2 3 4 --reps 40 --json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from backends.runtime.loader import load_runner
from backends.runtime.paged import SeqInput
from backends.runtime.spec_branches import fork_tail
from benchmarks.common import command_line, emit, log, run_meta


def layouts(pool, pages: list[int], last: int, start: int, chains: list[list[int]]) -> dict:
    """layout name -> the forward's inputs for these chains (the first is the sequence's own)."""
    tails = [fork_tail(pool, pages, start, start + len(c))[0] for c in chains[1:]]
    first = SeqInput([last] + chains[0], start, pages)
    alts = list(zip(chains[1:], tails, strict=True))
    return {
        "separate": [first] + [SeqInput([last] + c, start, t) for c, t in alts],
        "rooted": [first] + [SeqInput(c, start + 1, t, root=0) for c, t in alts],
    }


def summary(times: list[float]) -> dict:
    ms = sorted(1e3 * t for t in times)
    return {
        "median_ms": statistics.median(ms),
        "p99_ms": ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))],
        "min_ms": ms[0],
        "max_ms": ms[-1],
    }


def measure(target, width: int, args) -> dict:
    g = torch.Generator().manual_seed(width)
    vocab = target.config.vocab_size
    tokens = torch.randint(3, vocab, (args.context + 1 + width * args.k,), generator=g).tolist()
    context, last = tokens[: args.context], tokens[args.context]
    drafts = tokens[args.context + 1 :]
    chains = [drafts[i * args.k : (i + 1) * args.k] for i in range(width)]
    ps = 16
    pool = target.make_pool(-(-(args.context + args.k + 1) // ps) * (width + 1) + 2, ps)
    pages = pool.alloc(-(-(args.context + args.k + 1) // ps))
    target.prefill(pool, context, pages)
    inputs = layouts(pool, pages, last, args.context, chains)
    times: dict[str, list[float]] = {name: [] for name in inputs}
    for rep in range(args.reps + 1):  # the first pass of each warms up
        for name, seqs in inputs.items():
            t0 = time.perf_counter()
            target.forward(pool, seqs, features=True)
            if rep:
                times[name].append(time.perf_counter() - t0)
    rows = {name: sum(len(s.token_ids) for s in seqs) for name, seqs in inputs.items()}
    out = {"branches": width, "k": args.k, "context": args.context, "rows": rows}
    out.update({name: summary(t) for name, t in times.items()})
    saved = rows["separate"] - rows["rooted"]
    delta = out["separate"]["median_ms"] - out["rooted"]["median_ms"]
    out["rooted_over_separate"] = out["rooted"]["median_ms"] / out["separate"]["median_ms"]
    out["ms_per_row_saved"] = delta / saved if saved else None
    log(f"W={width}: {out}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--branches", nargs="+", type=int, default=[1, 2, 3, 4])
    ap.add_argument("--k", type=int, default=3, help="drafts a chain")
    ap.add_argument("--context", type=int, default=100, help="tokens before the last one")
    ap.add_argument("--reps", type=int, default=40, help="timed passes a layout")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    args.runs = args.reps
    target = load_runner(args.model, dtype=args.dtype, device=args.device)
    results = [measure(target, w, args) for w in args.branches]
    meta = run_meta(args, command=command_line("benchmarks.verify_rows", argv))
    header = ["W", "rows separate / rooted", "separate ms p50 (p99)", "rooted ms p50 (p99)",
              "rooted / separate", "ms a row saved"]  # fmt: skip
    table = [
        [
            r["branches"],
            f"{r['rows']['separate']} / {r['rows']['rooted']}",
            f"{r['separate']['median_ms']:.1f} ({r['separate']['p99_ms']:.1f})",
            f"{r['rooted']['median_ms']:.1f} ({r['rooted']['p99_ms']:.1f})",
            f"{r['rooted_over_separate']:.3f}",
            "-" if r["ms_per_row_saved"] is None else f"{r['ms_per_row_saved']:.2f}",
        ]
        for r in results
    ]
    emit({**meta, "results": results}, args.json, header, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
