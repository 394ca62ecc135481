"""Where a served token's time goes: client arrival times against the stages' trace spans.

Starts one default ``scripts/serve.sh`` (prefill and decode inside one tritonserver) with
``trace_dir`` set, streams completions through the OpenAI front (concurrent clients, each sending
its next request when the last one ended, ``ignore_eos``), stops the server and joins:

* the client's arrival time of every streamed token (``time.time()``, same host as the server);
* decode's ``decode-step`` spans: wall time of each engine step, the decode thread's CPU time in it
  (wall - CPU = the thread waited for a core: prefill or another process had it), the gap
  since the previous step ended (the decode loop outside the engine: admission, KV arrivals,
  idle), and when the step's tokens were handed to Triton;
* prefill's spans (start, computed) and decode's per-request record (submitted, first token).

Per served token: ITL = engine step (CPU + wait for cores) + loop gap, and the delivery lag
(client arrival - the latest step hand-off before it: postprocess, ensemble, gRPC, the OpenAI
front, HTTP) added to every token. Per request: TTFT = wait before prefill starts + prefill.

    .venv/bin/python -m benchmarks.trace_split --json   # then, the old batching:
    .venv/bin/python -m benchmarks.trace_split --json --set prefill.prefill_batch_tokens=4096
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import random
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks import ROOT

HTTP_PORT, OPENAI_PORT = 8310, 9310
WORDS = "the cat sat on a mat while dogs ran over green hills and quiet rivers".split()


def log(msg: str) -> None:
    print(f"[split] {msg}", file=sys.stderr, flush=True)


async def _one(session, url: str, prompt: str, osl: int) -> dict:
    body = {"model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": osl,
            "stream": True, "ignore_eos": True}  # fmt: skip
    sent, times = time.time(), []
    async with session.post(url, json=body) as r:
        async for line in r.content:
            if line.startswith(b"data: {"):
                times.append(time.time())
    return {"sent": sent, "times": times}


async def drive(isl: int, osl: int, conc: int, per_client: int) -> list[dict]:
    import aiohttp

    url = f"http://127.0.0.1:{OPENAI_PORT}/v1/completions"
    out: list[dict] = []

    def prompt(seed: int) -> str:  # about isl tokens: one token per word with this vocabulary
        rng = random.Random(seed)
        return " ".join(rng.choice(WORDS) for _ in range(isl))

    async def client(s, w: int) -> None:
        for k in range(per_client):
            out.append(await _one(s, url, prompt(1000 * w + k), osl))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as s:
        await _one(s, url, prompt(-1), 4)  # warm-up
        await asyncio.gather(*(client(s, w) for w in range(conc)))
    return out


def split(reqs: list[dict], trace_dir: str) -> dict:
    recs = [json.loads(x) for f in glob.glob(f"{trace_dir}/*.jsonl") for x in open(f)]
    steps = sorted((r for r in recs if r["stage"] == "decode-step"), key=lambda r: r["end"])
    t0 = min(r["sent"] for r in reqs)
    steps = [s for s in steps if s["start"] >= t0]
    sent = np.array([s["sent"] for s in steps])
    gaps = [b["start"] - a["end"] for a, b in zip(steps, steps[1:], strict=False)]
    lag = []
    for r in reqs:
        for t in r["times"][1:]:
            i = np.searchsorted(sent, t) - 1
            if i >= 0:
                lag.append(t - sent[i])
    itl = [b - a for r in reqs for a, b in zip(r["times"], r["times"][1:], strict=False)]
    wall = [s["end"] - s["start"] for s in steps]
    cpu = [min(s["cpu"], s["end"] - s["start"]) for s in steps]
    pre = {r["room"]: r for r in recs if r["stage"] == "prefill" and "start" in r}
    dec = [r for r in recs if r["stage"] == "decode" and r.get("room") in pre]
    dec = [r for r in dec if r["submitted"] >= t0]
    med = lambda xs: float(np.median(xs)) * 1e3 if len(xs) else float("nan")  # noqa: E731
    return {
        "tokens": len(itl) + len(reqs), "steps": len(steps),
        "batch_mean": float(np.mean([s["batch"] for s in steps])) if steps else 0.0,
        "itl_ms": med(itl), "itl_mean_ms": float(np.mean(itl)) * 1e3,
        "step_wall_ms": float(np.mean(wall)) * 1e3, "step_cpu_ms": float(np.mean(cpu)) * 1e3,
        "step_wait_ms": float(np.mean(np.subtract(wall, cpu))) * 1e3,
        "loop_gap_ms": float(np.mean(gaps)) * 1e3 if gaps else 0.0,
        "delivery_lag_ms": med(lag),
        "ttft_ms": med([r["times"][0] - r["sent"] for r in reqs if r["times"]]),
        "prefill_wait_ms": med([pre[r["room"]]["start"] - r["submitted"] for r in dec]),
        "prefill_ms": med([pre[r["room"]]["computed"] - pre[r["room"]]["start"] for r in dec]),
    }  # fmt: skip


def run_load(args, isl: int, osl: int, conc: int) -> dict:
    trace = tempfile.mkdtemp(prefix="pd-split-")
    serve = ["bash", f"{ROOT}/scripts/serve.sh", "--http-port", str(HTTP_PORT),
             "--openai-port", str(OPENAI_PORT), "--set", f"trace_dir={trace}"]  # fmt: skip
    for s in args.set:
        serve += ["--set", s]
    subprocess.run(serve, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    try:
        reqs = asyncio.run(drive(isl, osl, conc, args.per_client))
    finally:
        stop = ["bash", f"{ROOT}/scripts/serve.sh", "--stop", "--http-port", str(HTTP_PORT)]
        subprocess.run(stop, cwd=ROOT, stdout=subprocess.DEVNULL)
    res = {"isl": isl, "osl": osl, "concurrency": conc, **split(reqs, trace)}
    log(json.dumps(res))
    return res


COLS = [("TTFT p50", "ttft_ms"), ("wait before prefill", "prefill_wait_ms"),
        ("prefill", "prefill_ms"), ("ITL p50", "itl_ms"), ("ITL mean", "itl_mean_ms"),
        ("step wall", "step_wall_ms"), ("step CPU", "step_cpu_ms"),
        ("step wait for cores", "step_wait_ms"), ("loop gap", "loop_gap_ms"),
        ("delivery lag p50", "delivery_lag_ms")]  # fmt: skip


def table(rows: list[dict]) -> str:
    out = ["| load | " + " | ".join(c for c, _ in COLS) + " | batch |",
           "|---|" + "---:|" * (len(COLS) + 1)]  # fmt: skip
    for r in rows:
        cells = " | ".join(f"{r[k]:.0f}" for _, k in COLS)
        out.append(f"| {r['isl']}/{r['osl']} c{r['concurrency']} | {cells} | "
                   f"{r['batch_mean']:.1f} |")  # fmt: skip
    return "\n".join(out) + "\n(ms; step rows are means per engine step, one token per sequence)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--loads", default="128x32x4,512x128x8", help="ISLxOSLxCONCURRENCY,...")
    ap.add_argument("--per-client", type=int, default=3, help="requests each client sends")
    ap.add_argument("--set", action="append", default=[], help="serve.sh --set, repeatable")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = [run_load(args, *map(int, load.split("x"))) for load in args.loads.split(",")]
    if args.json:
        print(json.dumps({"sets": args.set, "loads": rows}))
    else:
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
