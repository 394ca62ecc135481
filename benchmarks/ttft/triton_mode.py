"""Triton mode: the same transfer modes through the real ensemble, client-side TTFT over gRPC.

One tritonserver per mode, each from its own copy of the repository (scripts/make_repo.py) with
the prefill stage's layer-group parameters rewritten; servers run side by side on different
ports (inside the benchmark's network namespace when a link is emulated) and are measured
interleaved, like the direct mode. TTFT = the client sends ``input_ids`` on a gRPC stream ->
the first streamed response arrives (max_tokens 1). The ensemble has no colocated path, so the
exposed fraction uses the direct colocated TTFT as the floor (Triton overhead then counts as
exposed; the table shows Triton - direct per mode).
"""

from __future__ import annotations

import math
import os
import queue
import subprocess
import sys
import time

import numpy as np

from benchmarks import ROOT

from .analysis import FIXED_MODES

BASE_PORT = 18100


def mode_sets(mode: str, num_layers: int) -> list[str]:
    """make_repo ``--set`` items that turn the repository into ``mode``."""
    if mode == "serial":
        return ["prefill.lg_enabled=false"]
    if mode == "pipelined":
        return []
    if mode in FIXED_MODES:
        k = FIXED_MODES[mode] or num_layers
        return [f"prefill.lg_fixed_group_size={math.ceil(num_layers / k)}"]
    raise ValueError(f"mode {mode!r} has no Triton repository (colocated is direct-only)")


def triton_groups(mode: str, num_tokens: int, num_layers: int) -> int:
    """How many groups the prefill stage of ``mode``'s repository streams."""
    from backends.stages.policy import LayerGroupPolicy

    if mode == "serial":
        return 1
    if mode == "pipelined":
        return len(LayerGroupPolicy().groups(num_tokens, num_layers))
    k = FIXED_MODES[mode] or num_layers
    return len(LayerGroupPolicy(fixed_group_size=math.ceil(num_layers / k)).groups(0, num_layers))


class TritonServers:
    def __init__(
        self,
        model_path: str,
        modes: list[str],
        num_layers: int,
        max_tokens: int,
        max_len: int,
        out_dir: str,
        log=print,
    ):
        self.ports: dict[str, int] = {}
        self.run_dir = os.path.join(out_dir, "triton")
        self.log = log
        pages = -(-max_tokens // 16) + 64
        common = [
            f"num_pages={pages}",
            f"max_context={max_len + 2}",
            "max_tokens_limit=1",
            "transfer_timeout_s=600",
            "bootstrap_timeout_s=120",
        ]
        for i, mode in enumerate(modes):
            repo = os.path.join(self.run_dir, f"repo-{mode}")
            make_repo(repo, model_path, common + mode_sets(mode, num_layers))
            port = BASE_PORT + 10 * i
            env = dict(os.environ, PD_RUN_DIR=self.run_dir)
            cmd = [
                os.path.join(ROOT, "scripts", "serve.sh"),
                "--model-repo",
                repo,
                "--http-port",
                str(port),
                "--grpc-port",
                str(port + 1),
                "--metrics-port",
                str(port + 2),
            ]
            log(f"[triton] starting {mode} on gRPC {port + 1}")
            res = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if res.returncode != 0:
                self.close()
                raise RuntimeError(f"serve.sh for {mode} failed:\n{res.stdout}\n{res.stderr}")
            self.ports[mode] = port

    def close(self) -> None:
        for _mode, port in self.ports.items():
            subprocess.run(
                [os.path.join(ROOT, "scripts", "serve.sh"), "--stop", "--http-port", str(port)],
                env=dict(os.environ, PD_RUN_DIR=self.run_dir),
                capture_output=True,
            )
        self.ports.clear()

    def run(self, mode: str, prompts: list[list[int]], timeout: float = 900) -> list[dict]:
        """Send every prompt at once on one gRPC stream; client-side TTFT per request."""
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(f"127.0.0.1:{self.ports[mode] + 1}")
        results: queue.Queue = queue.Queue()
        client.start_stream(
            callback=lambda result, error: results.put((time.perf_counter(), result, error))
        )
        t0 = time.perf_counter()
        try:
            for j, ids in enumerate(prompts):
                client.async_stream_infer("ensemble", _inputs(ids), request_id=str(j))
            first: dict[str, tuple[float, int]] = {}
            deadline = time.time() + timeout
            while len(first) < len(prompts):
                t, r, err = results.get(timeout=max(1.0, deadline - time.time()))
                if err is not None:
                    raise RuntimeError(f"triton {mode}: {err}")
                rid = r.get_response().id
                ids = r.as_numpy("output_ids")
                if rid not in first and ids is not None and ids.size:
                    first[rid] = (t, int(ids.reshape(-1)[0]))
        finally:
            client.stop_stream()
            client.close()
        return [
            {
                "mode": mode,
                "ttft_ms": (first[str(j)][0] - t0) * 1e3,
                "first_token": first[str(j)][1],
            }
            for j in range(len(prompts))
        ]


def make_repo(out: str, model: str, sets: list[str]) -> None:
    """A copy of model_repository/ at ``out`` with ``sets`` applied (scripts/make_repo.py)."""
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "make_repo.py"), "--out", out]
    cmd += ["--model", model, *(a for s in sets for a in ("--set", s))]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"make_repo.py --out {out} failed: {res.stderr.strip()[-2000:]}")


def _inputs(ids: list[int]):
    import tritonclient.grpc as grpcclient

    fields = [
        ("input_ids", np.array(ids, np.int32), "INT32"),
        ("max_tokens", np.array([1], np.int32), "INT32"),
        ("ignore_eos", np.array([True]), "BOOL"),
        ("stream", np.array([True]), "BOOL"),
    ]
    out = []
    for name, arr, dt in fields:
        t = grpcclient.InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out
