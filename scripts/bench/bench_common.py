"""Small pieces every benchmark script shares: progress logging and the run's metadata."""

from __future__ import annotations

import platform
import sys

import torch


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


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
