"""Serving benchmark at equal cores (2): disaggregated (1 prefill + 1 decode server, one core
each) against two colocated replicas of one core each behind round-robin (the comparison
DistServe makes) and against one colocated server on both cores, under Poisson arrivals of short
chat prompts mixed with long (~2K-token) prompts.

    .venv/bin/python -m benchmarks.serving --rates 0.2,0.4,0.6 --requests 60 \\
        --out bench_out/serving

Each configuration is started by this script with ``scripts/serve.sh`` under ``taskset``:

* ``pd``: ``--role prefill`` on core 0 and ``--role decode --prefill-servers ...`` on core 1
  (``OMP_NUM_THREADS=1`` each: one core each);
* ``pd-local``: the same with conditional disaggregation: the decode server prefills prompts of
  at most 256 tokens itself (``router.local_prefill_max_tokens``), so short prompts never queue
  behind long ones at the prefill server;
* ``replicas``: two colocated servers (as below), one on core 0 and one on core 1
  (``OMP_NUM_THREADS=1`` each); the client sends request i to replica i mod 2;
* ``colocated``: ``--role decode`` with ``router.local_prefill_max_tokens`` above every prompt
  (conditional disaggregation set to prefill everything locally, no prefill server) on cores
  0-1 with ``OMP_NUM_THREADS=2``.

Per configuration: an idle run (short requests one at a time: the ITL at idle), then one run per
rate. Every request streams (gRPC); the client records the send time and each response's arrival.
TTFT = first token - send; ITL = gaps between later tokens. Goodput at the SLO = requests/s whose
TTFT and p99 ITL both meet it (the TTFT limit depends on the prompt's class).

Own client, not aiperf: aiperf 0.13 can drive the ensemble's generate_stream (docs/FACTS), but it
would need its own virtual environment on the shared benchmark host, and this benchmark needs
per-token arrival times of each request aligned with the long prompts' arrival times (the ITL
over time plot) and two prompt classes with exact token counts, which a ~100-line client does
directly.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import subprocess
import sys
import threading
import time

import numpy as np

from benchmarks import ROOT

SERVE = os.path.join(ROOT, "scripts", "serve.sh")
CORES = 2  # every configuration gets cores 0-1
LOCAL = 256  # pd-local: the decode server prefills prompts up to this many tokens itself
SHORT_PROMPTS = [
    "What is the capital of France?", "Write a haiku about autumn.",
    "Give me three tips for sleep.", "Explain what a prime number is.",
    "Name two famous painters.", "How do airplanes fly?",
    "Suggest a name for a cat.", "What is the boiling point of water?",
]  # fmt: skip


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# ---- servers ------------------------------------------------------------------------------------
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Servers:
    """The servers of one configuration, started with serve.sh under taskset."""

    def __init__(self, mode: str, run_dir: str, sets: list[str]):
        self.started: list[tuple[int, dict]] = []
        common = [a for s in sets for a in ("--set", s)]
        secret = os.path.join(run_dir, "secret")
        if mode.startswith("pd"):
            p = self._start("0", "1", run_dir, ["--role", "prefill", *common], secret)
            servers = f"127.0.0.1:{p[1]}:{p[2]}"
            local = (
                ["--set", f"router.local_prefill_max_tokens={LOCAL}"] if mode == "pd-local" else []
            )
            self.ports = self._start(
                "1", "1", run_dir,
                ["--role", "decode", "--prefill-servers", servers, *local, *common], secret,
            )  # fmt: skip
            self.urls = [f"127.0.0.1:{self.ports[1]}"]
        else:
            local = ["--role", "decode", "--set", "router.local_prefill_max_tokens=100000"]
            places = [("0", "1"), ("1", "1")] if mode == "replicas" else [("0,1", "2")]
            self.urls = [
                f"127.0.0.1:{self._start(c, t, run_dir, [*local, *common], secret)[1]}"
                for c, t in places
            ]

    def _start(self, cores: str, threads: str, run_dir: str, args: list[str], secret: str):
        ports = [free_port() for _ in range(3)]
        env = {**os.environ, "PD_RUN_DIR": run_dir, "OMP_NUM_THREADS": threads,
               "GLOG_minloglevel": "2"}  # fmt: skip
        cmd = ["taskset", "-c", cores, SERVE, *args, "--secret-file", secret]
        cmd += ["--http-port", str(ports[0]), "--grpc-port", str(ports[1])]
        cmd += ["--metrics-port", str(ports[2])]
        log(" ".join(cmd))
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        self.started.append((ports[0], env))
        return ports

    def stop(self) -> None:
        for http, env in self.started:
            subprocess.run([SERVE, "--stop", "--http-port", str(http)], env=env,
                           stdout=subprocess.DEVNULL)  # fmt: skip


# ---- client -------------------------------------------------------------------------------------
def _inputs(job: dict):
    import tritonclient.grpc as g

    def t(name, arr, dt):
        x = g.InferInput(name, list(arr.shape), dt)
        x.set_data_from_numpy(arr)
        return x

    ins = [
        t("max_tokens", np.array([job["max_tokens"]], np.int32), "INT32"),
        t("stream", np.array([True]), "BOOL"),
        t("ignore_eos", np.array([True]), "BOOL"),
    ]
    if job["ids"] is not None:
        ins.append(t("input_ids", np.array(job["ids"], np.int32), "INT32"))
    else:
        ins.append(t("text_input", np.array([job["text"].encode()], np.object_), "BYTES"))
        ins.append(t("apply_chat_template", np.array([True]), "BOOL"))
    return ins


def one_request(url: str, job: dict, rec: dict) -> None:
    """Stream one request; fills rec: sent, token times, error."""
    import tritonclient.grpc as g

    q: queue.Queue = queue.Queue()
    c = g.InferenceServerClient(url)
    c.start_stream(callback=lambda result, error: q.put((time.monotonic(), result, error)))
    rec["sent"] = time.monotonic()
    c.async_stream_infer("ensemble", _inputs(job), enable_empty_final_response=True)
    try:
        while True:
            t, r, e = q.get(timeout=600)
            if e is not None:
                rec["error"] = str(e)
                break
            ids = r.as_numpy("output_ids")
            n = 0 if ids is None else ids.size
            rec["times"] += [t] * n
            final = r.get_response().parameters.get("triton_final_response")
            if final and final.bool_param:
                break
    finally:
        c.stop_stream()
        c.close()


def workload(n: int, rate: float, long_frac: float, long_tokens: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    t, jobs = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)  # Poisson arrivals
        if rng.random() < long_frac:
            ids = [rng.randrange(1000, 40000) for _ in range(long_tokens)]
            jobs.append({"at": t, "cls": "long", "ids": ids, "text": None, "max_tokens": 16})
        else:
            text = SHORT_PROMPTS[i % len(SHORT_PROMPTS)]
            jobs.append({"at": t, "cls": "short", "ids": None, "text": text, "max_tokens": 48})
    return jobs


def run_jobs(urls: list[str], jobs: list[dict]) -> list[dict]:
    """Send each job at its time, job i to ``urls[i % len(urls)]`` (round-robin)."""
    recs = [{"cls": j["cls"], "times": [], "error": None, "at": j["at"]} for j in jobs]
    t0 = time.monotonic()
    threads = []
    for i, (j, rec) in enumerate(zip(jobs, recs, strict=True)):
        time.sleep(max(0.0, t0 + j["at"] - time.monotonic()))
        url = urls[i % len(urls)]
        th = threading.Thread(target=one_request, args=(url, j, rec), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    for rec in recs:  # relative to the run's start
        rec["sent"] -= t0
        rec["times"] = [x - t0 for x in rec["times"]]
    return recs


# ---- analysis -----------------------------------------------------------------------------------
def pct(xs, q) -> float:
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def summarize(recs: list[dict], ttft_slo: dict, itl_slo: float) -> dict:
    ok = [r for r in recs if not r["error"] and r["times"]]
    ttft = [(r["times"][0] - r["sent"]) for r in ok]
    itl = [g for r in ok for g in np.diff(r["times"]).tolist() if g > 0]
    good = 0
    for r in ok:
        gaps = np.diff(r["times"])
        gaps = gaps[gaps > 0]
        p99 = float(np.percentile(gaps, 99)) if gaps.size else 0.0
        if r["times"][0] - r["sent"] <= ttft_slo[r["cls"]] and p99 <= itl_slo:
            good += 1
    span = max(r["times"][-1] for r in ok) if ok else 1.0
    return {
        "requests": len(recs), "errors": len(recs) - len(ok),
        "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
        "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99),
        "goodput": good / span, "good": good, "span_s": span,
    }  # fmt: skip


def plots(results: dict, out: str, rate_for_timeline: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(results)
    fig, axes = plt.subplots(len(modes), 1, figsize=(9, 3 * len(modes)), sharex=True, squeeze=False)
    for ax, mode in zip(axes[:, 0], modes, strict=True):
        recs = results[mode]["runs"][str(rate_for_timeline)]["records"]
        for r in recs:
            ts = np.asarray(r["times"])
            gaps = np.diff(ts)
            keep = gaps > 0
            if keep.any():
                ax.scatter(ts[1:][keep], gaps[keep] * 1000, s=4, color="tab:blue")
            if r["cls"] == "long":
                ax.axvline(r["sent"], color="tab:red", alpha=0.4, lw=1)
        ax.set_yscale("log")
        ax.set_ylabel("ITL ms")
        ax.set_title(f"{mode}: ITL over time at {rate_for_timeline} req/s (red: long prompt sent)")
    axes[-1, 0].set_xlabel("s since start")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "serving_itl_timeline.png"), dpi=110)
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in modes:
        runs = results[mode]["runs"]
        rates = sorted(float(r) for r in runs)
        per_core = [runs[str(r)]["summary"]["goodput"] / CORES for r in rates]
        ax.plot(rates, per_core, marker="o", label=mode)
    ax.set_xlabel("offered load, req/s")
    ax.set_ylabel("goodput at SLO per core, req/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "serving_goodput.png"), dpi=110)


def table(results: dict) -> str:
    rows = [
        "| config | load req/s | TTFT p50 / p99 s | ITL p50 / p99 ms | ITL p99 / idle ITL p99 | "
        "goodput req/s | per core | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode, res in results.items():
        idle = res["idle"]["summary"]
        rows.append(
            f"| {mode} | idle | {idle['ttft_p50']:.2f} / {idle['ttft_p99']:.2f} | "
            f"{idle['itl_p50'] * 1e3:.0f} / {idle['itl_p99'] * 1e3:.0f} | 1.00 | - | - | "
            f"{idle['errors']} |"
        )
        for rate, run in sorted(res["runs"].items(), key=lambda kv: float(kv[0])):
            s = run["summary"]
            rows.append(
                f"| {mode} | {rate} | {s['ttft_p50']:.2f} / {s['ttft_p99']:.2f} | "
                f"{s['itl_p50'] * 1e3:.0f} / {s['itl_p99'] * 1e3:.0f} | "
                f"{s['itl_p99'] / idle['itl_p99']:.2f} | {s['goodput']:.3f} | "
                f"{s['goodput'] / CORES:.3f} | {s['errors']} |"
            )
    return "\n".join(rows) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default="pd,replicas,colocated")
    ap.add_argument("--rates", default="0.2,0.4,0.6", help="offered loads, requests/s")
    ap.add_argument("--requests", type=int, default=60, help="per rate")
    ap.add_argument("--long-frac", type=float, default=0.25)
    ap.add_argument("--long-tokens", type=int, default=1900)
    ap.add_argument("--ttft-slo-short", type=float, default=3.0, help="s")
    ap.add_argument("--ttft-slo-long", type=float, default=15.0, help="s")
    ap.add_argument("--itl-slo", type=float, default=0.5, help="per-request p99 ITL limit, s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench_out", "serving"))
    ap.add_argument("--merge", default="", help="an earlier run's serving.json: its configurations"
                    " join this run's table and plots")  # fmt: skip
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rates = [float(r) for r in args.rates.split(",")]
    slo = {"short": args.ttft_slo_short, "long": args.ttft_slo_long}
    sets = ["num_pages=1024", "max_context=2048"]
    results: dict = {}
    if args.merge:
        with open(args.merge) as f:
            results.update(json.load(f)["results"])
    for mode in args.modes.split(","):
        run_dir = os.path.join(args.out, f"run-{mode}")
        os.makedirs(run_dir, exist_ok=True)
        srv = Servers(mode, run_dir, sets)
        try:
            idle_jobs = [j for j in workload(6, 1.0, 0.0, 0, args.seed)]
            recs = []
            for j in idle_jobs:  # one at a time: nothing else running
                recs += run_jobs(srv.urls, [{**j, "at": 0.0}])
            res = {"idle": {"summary": summarize(recs, slo, args.itl_slo)}, "runs": {}}
            log(f"{mode} idle: {res['idle']['summary']}")
            for rate in rates:
                jobs = workload(args.requests, rate, args.long_frac, args.long_tokens, args.seed)
                recs = run_jobs(srv.urls, jobs)
                s = summarize(recs, slo, args.itl_slo)
                res["runs"][str(rate)] = {"summary": s, "records": recs}
                log(f"{mode} {rate} req/s: {s}")
            results[mode] = res
        finally:
            srv.stop()
    meta = {"args": vars(args), "slo": {"ttft_s": slo, "itl_p99_s": args.itl_slo}}
    with open(os.path.join(args.out, "serving.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f)
    md = table(results)
    with open(os.path.join(args.out, "serving.md"), "w") as f:
        f.write(md)
    print(md)
    if len(results) >= 2:
        plots(results, args.out, rates[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
