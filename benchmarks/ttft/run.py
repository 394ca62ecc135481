"""Time to first token of PD disaggregation: colocated vs serial vs layer-pipelined KV transfer.

Modes, interleaved run by run (order rotated) so machine noise hits all of them alike:

* colocated: prefill and first token in one process, no transfer (the floor);
* serial: the whole KV sent after prefill (one group);
* pipelined: the adaptive ``LayerGroupPolicy`` (the serving default);
* fixed-2 / fixed-4 / fixed-8 / fixed-all: fixed group counts (the sweep, at --sweep-lengths).

Direct mode (always): prefill and decode stages in separate OS processes with the real runtime
and kvtransfer (:mod:`benchmarks.ttft.workers`); TTFT = submit -> decode has the first token with
the prompt's KV landed (decode registers concurrently with prefill, as in the ensemble).
Exposed fraction = (TTFT_mode - TTFT_colocated) / (TTFT_serial - TTFT_colocated).

``--link-gbit R`` re-runs the whole measurement inside ``unshare -n`` with a token bucket on the
namespace's loopback (root only), so the transfer can be made comparable to CPU prefill compute.

    .venv/bin/python -m benchmarks.ttft --quick --json           # < 5 min, emulated link
    .venv/bin/python -m benchmarks.ttft --link-gbit 0.3          # the full sweep
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from benchmarks import ROOT, netns
from benchmarks.common import command_line

from .analysis import ALL_MODES, BASE_MODES, FIXED_MODES, build_rows, headline

os.environ.setdefault("GLOG_minloglevel", "2")
MODULE = "benchmarks.ttft"  # how it is run (and re-run inside a namespace)
QUICK_LINK_GBIT = 0.15
QUICK = dict(models=["default"], lengths=[128, 2048], concurrency=[1], modes=list(BASE_MODES))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--models",
        nargs="+",
        default=["default", "kv-heavy"],
        help="'default' (SmolLM2), 'kv-heavy' (random MHA Llama) or checkpoint dirs",
    )
    ap.add_argument("--lengths", nargs="+", type=int, default=[128, 256, 1024, 2048, 4096])
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 8])
    ap.add_argument(
        "--max-batched-len",
        type=int,
        default=1024,
        help="concurrency > 1 only for prompts up to this length (time on 2 cores)",
    )
    ap.add_argument("--modes", nargs="+", default=list(ALL_MODES), choices=ALL_MODES)
    ap.add_argument(
        "--sweep-lengths",
        nargs="*",
        type=int,
        default=None,
        help="prompt lengths that run the fixed-* modes (default: the longest)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the prefill stage (1: compute keeps one core, the"
        " transfer thread the other; less sensitive to a shared machine)",
    )
    ap.add_argument("--device", default="cpu", help="stage device: cpu, cuda or cuda:N")
    ap.add_argument("--runs", type=int, default=3, help="measured runs per cell (medians)")
    ap.add_argument("--link-gbit", type=float, default=None, help="emulated link rate (Gbit/s)")
    ap.add_argument("--link-burst", default="1mb")
    ap.add_argument("--link-latency", default="50ms")
    ap.add_argument(
        "--quick",
        action="store_true",
        help=f"reduced sweep (< 5 min): {QUICK}, link {QUICK_LINK_GBIT} Gbit/s",
    )
    ap.add_argument(
        "--triton",
        action="store_true",
        help="also measure through the Triton ensemble (needs model_repository/)",
    )
    ap.add_argument("--out", default=str(ROOT / "bench_out" / "ttft"))
    ap.add_argument("--no-plots", dest="plots", action="store_false")
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--from-json", help="re-render tables/plots of a result.json (no run)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, list(v))
        args.sweep_lengths = []
        if args.link_gbit is None:
            args.link_gbit = QUICK_LINK_GBIT
    return validate(ap, args)


def validate(ap: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    if args.runs < 1:
        ap.error(f"--runs must be >= 1, got {args.runs}")
    if args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    if any(n < 1 for n in args.lengths):
        ap.error(f"--lengths must be positive token counts, got {args.lengths}")
    if any(c < 1 for c in args.concurrency):
        ap.error(f"--concurrency must be >= 1, got {args.concurrency}")
    if args.link_gbit is not None and not args.link_gbit > 0:
        ap.error(f"--link-gbit must be > 0 (Gbit/s), got {args.link_gbit}")
    missing = [m for m in ("colocated", "serial") if m not in args.modes]
    if missing:
        ap.error(f"--modes must include {missing}: the exposed fraction is relative to them")
    args.lengths = sorted(set(args.lengths))
    if args.sweep_lengths is None:
        args.sweep_lengths = [max(args.lengths)]
    bad = [n for n in args.sweep_lengths if n not in args.lengths]
    if bad:
        ap.error(f"--sweep-lengths {bad} are not in --lengths {args.lengths}")
    return args


def plan(args: argparse.Namespace) -> list[tuple[int, int, list[str]]]:
    """(prompt_len, concurrency, modes) cells for one model."""
    cells = []
    for conc in sorted(set(args.concurrency)):
        for n in args.lengths:
            if conc > 1 and n > args.max_batched_len:
                continue
            modes = [m for m in args.modes if m not in FIXED_MODES]
            if conc == 1 and n in args.sweep_lengths:
                modes += [m for m in args.modes if m in FIXED_MODES]
            cells.append((n, conc, modes))
    return cells


class Progress:
    def __init__(self, total: int):
        self.total, self.done, self.t0 = total, 0, time.time()

    def step(self, label: str) -> None:
        self.done += 1
        frac = self.done / self.total
        bar = "#" * int(30 * frac)
        el = time.time() - self.t0
        eta = el / frac - el if frac else 0
        sys.stderr.write(
            f"\r[{bar:<30}] {self.done}/{self.total} {el:4.0f}s eta {eta:4.0f}s {label:<40.40}"
        )
        sys.stderr.flush()
        if self.done == self.total:
            sys.stderr.write("\n")


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(10, vocab - 1) for _ in range(n)]


def bench_model(name: str, args, progress: Progress) -> list[dict]:
    from backends.runtime.config import ModelConfig

    from .direct import DirectBench
    from .models import resolve

    path = resolve(name)
    cfg = ModelConfig.from_pretrained(path)
    too_long = [n for n in args.lengths if n + 1 > cfg.max_position_embeddings]
    if too_long:
        raise SystemExit(f"{name}: prompts {too_long} exceed max_position_embeddings")
    cells = plan(args)
    os.makedirs(args.out, exist_ok=True)
    max_tokens = max(n * c for n, c, _ in cells)
    bench = DirectBench(path, max_tokens, args.threads, args.out, args.device)
    triton = start_triton(args, path, bench.num_layers, max_tokens)
    samples = []
    try:
        for mode in ("colocated", "serial", "pipelined"):  # warm-up: connections, allocator
            bench.run(mode, [prompt(300, cfg.vocab_size, 99)])
        for run in range(args.runs):
            for i, (n, conc, modes) in enumerate(cells):
                prompts = [prompt(n, cfg.vocab_size, args.seed + 1000 * n + j) for j in range(conc)]
                k = (run + i) % len(modes)
                for mode in modes[k:] + modes[:k]:
                    recs = bench.run(mode, prompts)
                    if triton and mode in triton.ports:
                        recs += triton_records(triton, mode, prompts, n, bench.num_layers)
                    for j, r in enumerate(recs):
                        r.update(model=name, prompt_len=n, concurrency=conc, run=run, request=j)
                        if j or run < args.runs - 1:
                            r.pop("timeline", None)  # keep one timeline per cell and mode
                    samples += recs
                    progress.step(f"{name} {n} tok c{conc} {mode}")
    finally:
        bench.close()
        if triton:
            triton.close()
    return samples


def start_triton(args, path: str, num_layers: int, max_tokens: int):
    """TritonServers for the transfer modes, or None (status recorded in args.triton_status)."""
    args.triton_status = triton_status(args)
    if not args.triton or args.triton_status["reason"]:
        return None
    from .triton_mode import TritonServers

    modes = [m for m in args.modes if m != "colocated"]
    log = lambda msg: sys.stderr.write(msg + "\n")  # noqa: E731
    try:
        servers = TritonServers(
            path, modes, num_layers, max_tokens, max(args.lengths), args.out, log
        )
    except Exception as e:  # report it, keep the direct measurement
        args.triton_status = {"included": False, "reason": f"start failed: {e}"[:2000]}
        return None
    args.triton_status = {"included": True, "reason": "", "modes": modes}
    return servers


def triton_records(triton, mode: str, prompts, n: int, num_layers: int) -> list[dict]:
    from .triton_mode import triton_groups

    recs = triton.run(mode, prompts)
    for r in recs:
        r.update(mode=f"triton:{mode}", groups=triton_groups(mode, n, num_layers))
    return recs


def triton_status(args) -> dict:
    if not args.triton:
        return {"included": False, "reason": "not requested (--triton)"}
    need = [ROOT / "model_repository", ROOT / "scripts" / "make_repo.py"]
    need.append(ROOT / "scripts" / "serve.sh")
    missing = [str(p.relative_to(ROOT)) for p in need if not p.exists()]
    if missing:
        return {"included": False, "reason": f"missing: {', '.join(missing)}"}
    return {"included": False, "reason": ""}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:  # re-render a finished run's tables and plots
        return finish(json.loads(Path(args.from_json).read_text()), args)
    if args.link_gbit is not None and not netns.in_netns():
        return netns.reexec_in_netns(MODULE, args.link_gbit, args.link_burst, args.link_latency)
    import torch

    link = netns.describe(args.link_gbit, args.link_burst, args.link_latency)
    sys.stderr.write(f"[bench_ttft] link: {json.dumps(link)}\n")
    total = sum(args.runs * len(m) for _, _, m in plan(args)) * len(args.models)
    progress = Progress(total)
    samples = []
    for name in args.models:
        samples += bench_model(name, args, progress)
    rows = build_rows(samples)
    short = [n for n in args.lengths if n < 256]
    long_len = max(args.lengths)
    out = headline(rows, long_len, short[0] if short else None, args.models[0])
    out.update(
        per_model={
            m: headline(rows, long_len, short[0] if short else None, m) for m in args.models
        },
        link=link,
        machine={
            "cpus": os.cpu_count(),
            "prefill_torch_threads": args.threads,
            "device": args.device,
            "torch": torch.__version__,
            "load_avg_at_end": os.getloadavg(),
        },
        triton=getattr(args, "triton_status", None) or triton_status(args),
        command=command_line(MODULE, argv),
        rows=rows,
        profiles=[s for s in samples if s.get("timeline")],
        samples=[{k: v for k, v in s.items() if k != "timeline"} for s in samples],
        title=(
            f"link {args.link_gbit:g} Gbit/s (tbf, measured {link['tcp_gbit_measured'][0]:.3f})"
            if args.link_gbit
            else "loopback, no rate limit"
        ),
    )
    return finish(out, args)


def finish(out: dict, args) -> int:
    """Write result.json, table.md and plots to --out; print the table or the JSON."""
    from .report import SUMMARY_KEYS, write_all

    table = write_all(out, args.out, args.plots)
    if args.json:
        print(json.dumps(out))
    else:
        print(table)
        for m, h in out["per_model"].items():
            pairs = ", ".join(f"{k}={h[k]}" for k in SUMMARY_KEYS)
            print(f"{m} @ {h['long_prompt_len']} tok: {pairs}")
    return 0
