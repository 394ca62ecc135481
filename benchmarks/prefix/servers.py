"""A mode's real servers: ``scripts/serve.sh`` (two ``--role prefill`` and one ``--role decode``
sharing a secret file, or one plain server), started in parallel, driven over Triton's gRPC
streaming API, their counters read from their metrics endpoints."""

from __future__ import annotations

import os
import queue
import re
import secrets
import subprocess
import time
import urllib.request

import numpy as np

from benchmarks import ROOT
from benchmarks.common import log

from .counters import counters_of
from .workload import Reply

SERVE = str(ROOT / "scripts" / "serve.sh")
MODEL = str(ROOT / "models" / "smollm2-135m-instruct")
PREFILL_SERVERS = 2
_LINE = re.compile(r"^(\w+)\{([^}]*)\}\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def scrape(url: str) -> list[tuple[str, dict, float]]:
    """Every labelled sample of a Prometheus endpoint: (name, labels, value)."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out = []
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            out.append((m[1], dict(_LABEL.findall(m[2])), float(m[3])))
    return out


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Servers:
    """One mode's servers, started with scripts/serve.sh (in parallel) and driven over gRPC."""

    settle_s = 1.0  # the stages export their counters every 0.25 s

    def __init__(self, layout: str, sets: dict, decode_sets: dict, run_dir: str, model: str):
        self.run_dir, self.started = run_dir, []
        os.makedirs(run_dir, exist_ok=True)
        self.secret = os.path.join(run_dir, "secret")
        with open(os.open(self.secret, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(secrets.token_hex(32) + "\n")  # written once: parallel starts share it
        common = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
        if model != MODEL:
            common += ["--model", model]
        self.starting: list[subprocess.Popen] = []
        try:
            if layout == "pd":
                prefills = [self._ports() for _ in range(PREFILL_SERVERS)]
                for p in prefills:
                    self.starting.append(self._start(p, ["--role", "prefill", *common], threads=1))
                servers = ",".join(f"127.0.0.1:{p[1]}:{p[2]}" for p in prefills)
                extra = [a for k, v in decode_sets.items() for a in ("--set", f"{k}={v}")]
                args = ["--role", "decode", "--prefill-servers", servers, *common, *extra]
                self.front = self._ports()
                self.starting.append(self._start(self.front, args, threads=1))
                self.metrics = [p[2] for p in prefills] + [self.front[2]]
            else:
                self.front = self._ports()
                self.starting.append(self._start(self.front, common, threads=2))
                self.metrics = [self.front[2]]
            for p in self.starting:
                if p.wait() != 0:
                    raise RuntimeError(f"serve.sh failed (logs in {run_dir})")
        except BaseException:
            self.stop()
            raise
        self.url = f"127.0.0.1:{self.front[1]}"

    def _ports(self) -> tuple[int, int, int]:
        return free_port(), free_port(), free_port()

    def _start(self, ports, args: list[str], threads: int) -> subprocess.Popen:
        env = {**os.environ, "PD_RUN_DIR": self.run_dir, "OMP_NUM_THREADS": str(threads)}
        env["GLOG_minloglevel"] = "2"
        cmd = [SERVE, *args, "--secret-file", self.secret, "--no-openai"]
        cmd += ["--http-port", str(ports[0]), "--grpc-port", str(ports[1])]
        cmd += ["--metrics-port", str(ports[2])]
        log(" ".join(cmd))
        self.started.append((ports[0], env))
        return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)

    def ask(self, ids: list[int], max_tokens: int, timeout: float = 600) -> Reply:
        """One streamed request to the ensemble (token ids, greedy)."""
        import tritonclient.grpc as g

        def t(name, arr, dt):
            x = g.InferInput(name, list(arr.shape), dt)
            x.set_data_from_numpy(arr)
            return x

        inputs = [
            t("input_ids", np.array(ids, np.int32), "INT32"),
            t("max_tokens", np.array([max_tokens], np.int32), "INT32"),
            t("stream", np.array([True]), "BOOL"),
        ]
        q: queue.Queue = queue.Queue()
        c = g.InferenceServerClient(self.url)
        c.start_stream(callback=lambda result, error: q.put((time.monotonic(), result, error)))
        rep = Reply(sent=time.monotonic())
        c.async_stream_infer("ensemble", inputs, enable_empty_final_response=True)
        try:
            while True:
                at, r, e = q.get(timeout=timeout)
                if e is not None:
                    rep.error = str(e)
                    return rep
                out = r.as_numpy("output_ids")
                if out is not None and out.size:
                    rep.first = rep.first or at
                    rep.ids += out.reshape(-1).tolist()
                cached = r.as_numpy("num_cached_tokens")
                if cached is not None:
                    rep.cached = int(cached.reshape(-1)[0])
                final = r.get_response().parameters.get("triton_final_response")
                if final and final.bool_param:
                    return rep
        except queue.Empty:
            rep.error = f"no answer in {timeout:g}s"
            return rep
        finally:
            c.stop_stream(cancel_requests=rep.error is not None)
            c.close()

    def counters(self) -> dict:
        urls = [f"http://127.0.0.1:{port}/metrics" for port in self.metrics]
        return counters_of([s for url in urls for s in scrape(url)])

    def stop(self) -> None:
        """``serve.sh --stop`` each server, once its start ended (a start interrupted early has
        no pid file yet: --stop would find nothing and the server would come up after)."""
        for p in self.starting:
            try:
                p.wait(timeout=600)
            except subprocess.TimeoutExpired:
                p.kill()
        for http, env in self.started:
            cmd = [SERVE, "--stop", "--http-port", str(http)]
            subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, check=False)
