"""Small pieces every benchmark script shares: progress logging, a median timing, the run's
metadata, and the result printed as JSON or as a table."""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time

import torch


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def median_ms(fn, reps: int) -> float:
    """``fn()`` once to warm up, then the median of ``reps`` timed calls, in ms."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def run_meta(args, **extra) -> dict:
    """What a result depends on besides the code: model, dtype, device, runs, threads, host."""
    return {
        "model": args.model,
        "dtype": args.dtype,
        "device": args.device,
        "runs": args.runs,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        **extra,
    }


def emit(out: dict, as_json: bool, header: list[str], rows) -> None:
    """``out`` as one JSON object, or ``rows`` (lists of cells) as a markdown table."""
    if as_json:
        print(json.dumps(out))
        return
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")
