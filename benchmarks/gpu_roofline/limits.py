"""The device's limits, measured in the run they bound: device-to-device copy bandwidth (the
decode roofline), a large matmul's FLOP/s (the prefill roofline), each from its fastest run (a
limit is what the device can do; a neighbour's load only slows a run), and for the KV transfer its
baseline, a plain device-to-host copy of the same bytes; the KV transfer itself runs
``python -m benchmarks.transfer`` in a child process (Mooncake's CUDA build may be absent, and a
failure inside it must not end this run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from benchmarks import ROOT

from .timing import percentile, samples, summary_ms

# the benchmarks.transfer layout with each shape's KV (pages of every layer, K and V)
TRANSFER_LAYOUTS = {"llama-3.1-8b": "llama8b-gqa", "qwen3-8b": "qwen3-8b-gqa"}
MOONCAKE_CHECK = "from kvtransfer.link.engine import _load_transfer_engine as f; f()"


def copy_bandwidth(device: torch.device, nbytes: int, runs: int) -> dict:
    """``dst.copy_(src)`` of ``nbytes``; GB/s counts the bytes read and written (2 x nbytes),
    as a decode step's reads are counted against it."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    t = samples(lambda: dst.copy_(src), runs, device, warmup=2)
    gbps = 2 * nbytes / min(t) / 1e9
    return {"gbps": round(gbps, 2), "bytes": nbytes, "ms": summary_ms(t)}


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int, runs: int) -> dict:
    """TFLOP/s of an n x n x n matmul through torch, in ``dtype``; on a CPU also in float32,
    the faster of the two counting as the peak (a CPU without bf16 instructions emulates it,
    and the runtime then widens its prefill GEMMs to float32)."""
    dtypes = [dtype] if device.type == "cuda" or dtype == torch.float32 else [dtype, torch.float32]
    per = {}
    for dt in dtypes:
        g = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(n, n, dtype=dt, device=device, generator=g)
        b = torch.randn(n, n, dtype=dt, device=device, generator=g)
        t = samples(lambda a=a, b=b: a @ b, runs, device, warmup=2)
        per[str(dt).removeprefix("torch.")] = {
            "tflops": round(2 * n**3 / min(t) / 1e12, 4),
            "ms": summary_ms(t),
        }
    best = max(per, key=lambda k: per[k]["tflops"])
    return {"tflops": per[best]["tflops"], "dtype": best, "n": n, "per_dtype": per}


def d2h_copy(device: torch.device, nbytes: int, runs: int) -> dict:
    """A plain copy of ``nbytes`` from the device into pinned and into pageable host memory
    (GB/s counts the bytes once): the baseline of a KV transfer from a CUDA pool."""
    if device.type != "cuda":
        return {"skipped": "CUDA only (a CPU pool has no device-to-host copy)"}
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    out = {"bytes": nbytes}
    for name, host in (
        ("pinned", torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)),
        ("pageable", torch.empty(nbytes, dtype=torch.uint8)),
    ):
        t = samples(lambda h=host: h.copy_(src, non_blocking=True), runs, device, warmup=1)
        out[f"{name}_gbps"] = round(nbytes / percentile(t, 50) / 1e9, 2)
        out[f"{name}_ms"] = summary_ms(t)
    return out


def child_env() -> dict:
    env = dict(os.environ, MC_FORCE_TCP=os.environ.get("MC_FORCE_TCP", "1"))
    env.setdefault("GLOG_minloglevel", "2")
    return env


def mooncake_missing() -> str:
    """'' when Mooncake's engine (and kvtransfer's control plane) imports here, else why not,
    asked of a child process (a failing CUDA build must not take this one down)."""
    try:
        check = subprocess.run([sys.executable, "-c", MOONCAKE_CHECK], cwd=ROOT, env=child_env(),
                               capture_output=True, text=True, timeout=120)  # fmt: skip
    except subprocess.TimeoutExpired:
        return "importing Mooncake took over 120 s"
    if check.returncode == 0:
        return ""
    last = (check.stderr.strip().splitlines() or [f"exit status {check.returncode}"])[-1]
    return f"no Mooncake transfer engine: {last}"


def kv_transfer(
    shape: str, tokens: int, requests: int, timeout_s: float, device: str = "cuda"
) -> dict:
    """``benchmarks.transfer`` from ``device`` pools with this shape's KV layout, page size 16,
    in a child process; ``{"skipped": why}`` where the child fails."""
    env = child_env()
    cmd = [sys.executable, "-m", "benchmarks.transfer", "--device", device,
           "--layouts", TRANSFER_LAYOUTS[shape], "--page-sizes", "16", "--tokens", str(tokens),
           "--requests", str(requests), "--json"]  # fmt: skip
    try:
        run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=timeout_s)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"skipped": f"benchmarks.transfer did not finish in {timeout_s:.0f} s"}
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("{")]
    if run.returncode != 0 or not lines:
        last = (run.stderr.strip().splitlines() or ["no output"])[-1]
        return {"skipped": f"benchmarks.transfer failed ({run.returncode}): {last}"}
    (cell,) = json.loads(lines[-1])["cells"]
    keep = ("layout", "tokens", "page_size", "bytes_per_request", "link_gbps",
            "fragmented_gbps", "contiguous_gbps", "runs")  # fmt: skip
    return {k: cell[k] for k in keep if k in cell}
