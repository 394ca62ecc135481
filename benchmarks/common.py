"""Small pieces the benchmarks share: progress logging, a median timing, the run's metadata, the
result printed as JSON or as a table, and a stress run's verdict (soak, fuzz_control)."""

from __future__ import annotations

import json
import platform
import shlex
import statistics
import sys
import time


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
    import torch

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


def command_line(module: str, argv: list[str] | None = None) -> str:
    """How this run was started, for its results: ``python -m module`` and its arguments."""
    return " ".join(shlex.quote(a) for a in ["python", "-m", module, *(argv or sys.argv[1:])])


def emit(out: dict, as_json: bool, header: list[str], rows) -> None:
    """``out`` as one JSON object, or ``rows`` (lists of cells) as a markdown table."""
    if as_json:
        print(json.dumps(out))
        return
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")


def print_result(result: dict, as_json: bool) -> int:
    """Print a run's verdict (one JSON object, or a line per field); the exit status."""
    if as_json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k}: {v}")
    return 0 if result["ok"] else 1
