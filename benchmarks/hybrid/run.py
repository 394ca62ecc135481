"""Command line of benchmarks.hybrid: the three parts, the run's metadata, the output."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

from benchmarks import ROOT, netns
from benchmarks.common import command_line, log

from . import exposed, models, report, shapes, speed

MODULE = "benchmarks.hybrid"
PARTS = ("bytes", "exposed", "speed")
# --quick: every part, at sizes that run in seconds (tiny models, short prompts, no link)
QUICK = dict(models=list(models.QUICK), exposed_lengths=[300], runs=1, prefill_lens=[64],
             batches=[2], context=16, decode_steps=2, speed_runs=1)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n")[0])
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument(
        "--lengths",
        nargs="+",
        type=int,
        default=list(shapes.DEFAULT_LENGTHS),
        help="prompt lengths of the bytes part (flagship shapes)",
    )
    ap.add_argument("--kv-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument(
        "--models",
        nargs="+",
        default=list(models.MINI),
        choices=list(models.SPECS),
        help="random hybrid checkpoints of the measured parts",
    )
    ap.add_argument("--exposed-lengths", nargs="+", type=int, default=[1024, 2048])
    ap.add_argument("--runs", type=int, default=10, help="requests per mode and cell (exposed)")
    ap.add_argument("--p99-min", type=int, default=20, help="samples needed to report a p99")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the prefill stage")
    ap.add_argument("--link-gbit", type=float, default=None, help="emulated link rate (Gbit/s)")
    ap.add_argument("--link-burst", default="1mb")
    ap.add_argument("--link-latency", default="50ms")
    ap.add_argument("--prefill-lens", nargs="+", type=int, default=[512, 2048])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--context", type=int, default=128, help="decode: prompt tokens first")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--speed-runs", type=int, default=3)
    ap.add_argument("--model-dir", default=str(ROOT / "bench_out" / "models"))
    ap.add_argument("--quick", action="store_true", help=f"CI smoke run: {QUICK}")
    ap.add_argument("--out", default=None, help="also write the JSON there")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--from-json", default=None, help="print the tables of a result (no run)")
    args = ap.parse_args(argv)  # fmt: skip
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    if args.runs < 1 or args.speed_runs < 1 or args.threads < 1:
        ap.error("--runs, --speed-runs and --threads must be >= 1")
    return args


def machine(link: dict | None) -> dict:
    import torch
    import transformers

    return {
        "date": datetime.date.today().isoformat(),
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_avg_start": list(os.getloadavg()),
        "link": link,
    }


def rounded(x):
    """``x`` with every float to 5 significant digits (the JSON stays readable and small)."""
    if isinstance(x, float):
        return float(f"{x:.5g}")
    if isinstance(x, dict):
        return {k: rounded(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [rounded(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        print(report.render(json.loads(Path(args.from_json).read_text())))
        return 0
    measured = {"exposed", "speed"} & set(args.parts)
    if args.link_gbit is not None and "exposed" in args.parts and not netns.in_netns():
        return netns.reexec_in_netns(MODULE, args.link_gbit, args.link_burst, args.link_latency)
    link = None
    if "exposed" in args.parts:
        link = netns.describe(args.link_gbit, args.link_burst, args.link_latency)
    out: dict = {"meta": {**machine(link), "command": command_line(MODULE, argv)}}
    if "bytes" in args.parts:
        out["bytes"] = shapes.measure(args.lengths, args.kv_dtype)
    paths = {}
    if measured:
        paths = {m: models.checkpoint(m, Path(args.model_dir)) for m in args.models}
        out["meta"]["models"] = {m: models.SPECS[m][1] for m in args.models}
    if "exposed" in args.parts:
        log(f"exposed: {args.models} at {args.exposed_lengths} tokens, {args.runs} runs")
        logs = os.path.join(args.model_dir, "..", "hybrid_logs")
        os.makedirs(logs, exist_ok=True)
        out["exposed"] = exposed.measure(
            paths, args.exposed_lengths, args.runs, args.threads, args.p99_min, logs
        )
        out["meta"]["load_avg_after_exposed"] = list(os.getloadavg())
    if "speed" in args.parts:
        log(f"speed: {args.models} vs transformers")
        out["speed"] = speed.measure(
            paths, args.prefill_lens, args.batches, args.context, args.decode_steps,
            args.speed_runs,
        )  # fmt: skip
    out["meta"]["load_avg_end"] = list(os.getloadavg())
    text = json.dumps(rounded(out))
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text if args.json else report.render(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
