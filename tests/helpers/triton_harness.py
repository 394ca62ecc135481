"""A real tritonserver for tests (scripts/serve.sh on a make_repo copy, free ports), the
transformers reference, and small gRPC / HTTP client helpers shared by the e2e tests."""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo
MODEL = os.path.join(ROOT, "models", "smollm2-135m-instruct")
MAX_CONTEXT = 512
MAX_TOKENS_LIMIT = 256

if not os.path.isfile(os.path.join(MODEL, "model.safetensors")):
    raise RuntimeError(f"default model missing at {MODEL}: run scripts/setup.sh")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    http: str
    grpc: str
    metrics_url: str
    trace_dir: str
    log: str
    openai: str = ""  # base URL of the OpenAI-compatible front (http://host:port/v1)

    @property
    def pid(self) -> int:
        """tritonserver's pid (it leads the process group of the whole server)."""
        with open(self.log[: -len(".log")] + ".pid") as f:
            return int(f.read())


def generated_ids(srv: Server, fields: dict, stream: bool) -> list[int]:
    """The token ids one HTTP generate request returns (streamed or not); asserts no error."""
    if stream:
        events = http_generate_stream(srv, {**fields, "stream": True})
        assert all("error" not in e for e in events), events
        return [t for e in events for t in _as_list(e["output_ids"])]
    out = http_generate(srv, fields)
    assert out["status"] == 200, out
    return _as_list(out["output_ids"])


def _as_list(x) -> list:
    return x if isinstance(x, list) else [x]


def launch(
    tmp,
    sets: list[str],
    instances: list[str] = (),
    repo_args: list[str] = (),
    env: dict = None,
    serve_args: list[str] = (),
) -> tuple[Server, list[str], dict]:
    """Start scripts/serve.sh on a make_repo copy (``--set`` items, ``--instances`` items, any
    other make_repo arguments such as ``--prefill-gpus 0``) in ``tmp`` on free ports, with
    ``serve_args`` added to serve.sh's (e.g. ``--api-key-file F``); returns (server, the serve.sh
    command, its env) for :func:`stop`."""
    repo, trace, run = tmp / "repo", tmp / "trace", tmp / "run"
    trace.mkdir()
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "make_repo.py"), "--out", str(repo)]
    # the suite's e2e runs verify every KV transfer end to end (kv_checksum; a test may set it
    # false: a later --set wins)
    cmd += [a for s in ["kv_checksum=true", *sets, f"trace_dir={trace}"] for a in ("--set", s)]
    cmd += [a for i in instances for a in ("--instances", i)]
    cmd += list(repo_args)
    subprocess.run(cmd, check=True, capture_output=True)
    ports = [str(free_port()) for _ in range(4)]
    serve = [os.path.join(ROOT, "scripts", "serve.sh"), "--model-repo", str(repo)]
    serve += ["--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2]]
    serve += ["--openai-port", ports[3], *serve_args]
    env = {**os.environ, **(env or {}), "PD_RUN_DIR": str(run)}
    out = subprocess.run(serve, env=env, timeout=400, stdout=subprocess.PIPE, text=True)
    sys.stderr.write(out.stdout)  # its URLs and log path; stdout stays the caller's
    out.check_returncode()
    srv = Server(
        f"127.0.0.1:{ports[0]}",
        f"127.0.0.1:{ports[1]}",
        f"http://127.0.0.1:{ports[2]}/metrics",
        str(trace),
        str(run / f"tritonserver-{ports[0]}.log"),
        f"http://127.0.0.1:{ports[3]}/v1",
    )
    return srv, serve, env


def stop(srv: Server, serve: list[str], env: dict, timeout_s: int = 30) -> None:
    """``serve.sh --stop``. After a stub died and its model was reloaded, Triton never unloads
    the dead version, so the stop takes the whole ``timeout_s`` (docs/operations.md): tests
    that killed a stub pass a short one."""
    port = srv.http.rsplit(":", 1)[1]
    cmd = serve[:1] + ["--stop", "--http-port", port, "--stop-timeout", str(timeout_s)]
    subprocess.run(cmd, env=env, timeout=timeout_s + 30)



def assert_stopped_with_nothing_in_flight(srv: Server) -> None:
    """After :func:`stop`: Triton found no request still in flight (one left open for good makes
    every stop wait out the whole exit timeout)."""
    with open(srv.log) as f:
        log = f.read()
    assert "Found 0 model versions that have in-flight inferences" in log, log[-3000:]

# ---- reference ---------------------------------------------------------------------------------
class Reference:
    def __init__(self):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(1)  # leave the cores to the server
        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(MODEL)
        self.model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
        self._cache: dict = {}

    def prompt_ids(self, text: str, chat: bool) -> list[int]:
        if chat:
            msgs = [{"role": "user", "content": text}]
            s = self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            return self.tok(s, add_special_tokens=False).input_ids
        return self.tok(text).input_ids

    def greedy(self, text: str, chat: bool, max_tokens: int) -> list[int]:
        key = (text, chat, max_tokens)
        if key not in self._cache:
            ids = self.prompt_ids(text, chat)
            with self.torch.no_grad():
                out = self.model.generate(
                    self.torch.tensor([ids]),
                    max_new_tokens=max_tokens,
                    do_sample=False,
                    eos_token_id=self.tok.eos_token_id,
                    pad_token_id=self.tok.eos_token_id,
                )
            self._cache[key] = out[0, len(ids) :].tolist()
        return self._cache[key]

    def text(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


# ---- clients -----------------------------------------------------------------------------------
TYPES = {
    "text_input": ("BYTES", np.object_),
    "input_ids": ("INT32", np.int32),
    "max_tokens": ("INT32", np.int32),
    "temperature": ("FP32", np.float32),
    "top_p": ("FP32", np.float32),
    "top_k": ("INT32", np.int32),
    "seed": ("INT64", np.int64),
    "stream": ("BOOL", np.bool_),
    "ignore_eos": ("BOOL", np.bool_),
    "apply_chat_template": ("BOOL", np.bool_),
    "messages": ("BYTES", np.object_),
    "presence_penalty": ("FP32", np.float32),
    "frequency_penalty": ("FP32", np.float32),
    "repetition_penalty": ("FP32", np.float32),
    "stop": ("BYTES", np.object_),
    "stop_words": ("BYTES", np.object_),
    "stop_token_ids": ("INT32", np.int32),
    "top_logprobs": ("INT32", np.int32),
    "echo": ("BOOL", np.bool_),
    "exclude_input_in_output": ("BOOL", np.bool_),
    "sampling_parameters": ("BYTES", np.object_),
    "return_num_input_tokens": ("BOOL", np.bool_),
    "return_num_output_tokens": ("BOOL", np.bool_),
    "return_logprobs": ("BOOL", np.bool_),
}


def grpc_input(name: str, value, dtype: str | None = None, np_dtype=None):
    import tritonclient.grpc as grpcclient

    dt, npt = TYPES[name]
    dt, npt = dtype or dt, np_dtype or npt
    value = value if isinstance(value, list) else [value]
    value = [v.encode() if isinstance(v, str) else v for v in value]
    arr = np.array(value, dtype=npt)
    t = grpcclient.InferInput(name, list(arr.shape), dt)
    t.set_data_from_numpy(arr)
    return t


class GrpcStream:
    """One gRPC stream; ``ask`` sends a request and collects its responses."""

    def __init__(self, url: str):
        import tritonclient.grpc as grpcclient

        self.results: queue.Queue = queue.Queue()
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=lambda result, error: self.results.put((result, error)))

    def send(self, inputs) -> None:
        self.client.async_stream_infer("ensemble", inputs, enable_empty_final_response=True)

    def next(self, timeout: float = 120):
        """(text piece, ids, final, error) of the next response."""
        result, error = self.results.get(timeout=timeout)
        if error is not None:
            status = error.status() if hasattr(error, "status") else None
            return "", [], True, f"[{status}] {error}" if status else str(error)
        final = result.get_response().parameters.get("triton_final_response")
        final = bool(final and final.bool_param)
        text = result.as_numpy("text_output")
        ids = result.as_numpy("output_ids")
        piece = "" if text is None else text.reshape(-1)[0].decode()
        return piece, [] if ids is None else ids.reshape(-1).tolist(), final, None

    def ask(self, inputs, timeout: float = 120):
        """-> (pieces, ids, error)"""
        self.send(inputs)
        pieces, ids = [], []
        while True:
            piece, new, final, err = self.next(timeout)
            if err:
                return pieces, ids, err
            if new or piece:
                pieces.append(piece)
                ids += new
            if final:
                return pieces, ids, None

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def outputs_of(result) -> dict:
    """Every output of one ensemble response, decoded (strings, lists, ints)."""
    out = {}
    for o in result.get_response().outputs:
        arr = result.as_numpy(o.name).reshape(-1)
        if arr.dtype == np.object_:
            out[o.name] = arr[0].decode()
        elif o.name in ("num_input_tokens", "num_output_tokens"):
            out[o.name] = int(arr[0])
        else:
            out[o.name] = arr.tolist()
    return out


def grpc_responses(url: str, fields: dict, timeout: float = 120) -> tuple[list[dict], str | None]:
    """Every response of one request (outputs_of each), and its error (or None)."""
    s = GrpcStream(url)
    try:
        s.send([grpc_input(k, v) for k, v in fields.items()])
        responses = []
        while True:
            result, error = s.results.get(timeout=timeout)
            if error is not None:
                return responses, str(error)
            final = result.get_response().parameters.get("triton_final_response")
            if result.get_response().outputs:
                responses.append(outputs_of(result))
            if final and final.bool_param:
                return responses, None
    finally:
        s.close()


def grpc_ask(url: str, fields: dict, timeout: float = 120):
    s = GrpcStream(url)
    try:
        return s.ask([grpc_input(k, v) for k, v in fields.items()], timeout)
    finally:
        s.close()


def http_post(url: str, body: dict, timeout: float = 120) -> tuple[int, str]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def http_generate(server: Server, fields: dict) -> dict:
    code, body = http_post(f"http://{server.http}/v2/models/ensemble/generate", fields)
    out = json.loads(body)
    out["status"] = code
    return out


def http_generate_stream(server: Server, fields: dict) -> list[dict]:
    url = f"http://{server.http}/v2/models/ensemble/generate_stream"
    _, body = http_post(url, fields)
    return [json.loads(ln[5:]) for ln in body.splitlines() if ln.startswith("data:")]


def metrics(server: Server) -> dict[tuple[str, str], float]:
    """(metric name, stage) -> value summed over instances."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
        text = r.read().decode()
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if not line.startswith("pd_"):
            continue
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{", 1)[0]
        stage = name_labels.split('stage="', 1)[1].split('"', 1)[0] if "stage=" in line else ""
        out[(name, stage)] = out.get((name, stage), 0.0) + float(value)
    return out


def assert_greedy(server: Server, reference, prompts: list[tuple[str, bool]], n: int) -> None:
    """Each (text, chat) prompt over gRPC, streamed and not in turn: the reference's greedy
    tokens and their text."""
    for (text, chat), stream in zip(prompts, [True, False] * len(prompts), strict=False):
        want = reference.greedy(text, chat, n)
        fields = {"text_input": text, "max_tokens": n, "apply_chat_template": chat}
        pieces, ids, err = grpc_ask(server.grpc, {**fields, "stream": stream})
        assert err is None, err
        assert ids == want, text
        assert "".join(pieces) == reference.text(want)


def until_served(server: Server, fields: dict, timeout: float = 180.0) -> dict:
    """``http_generate`` once a second until it answers with tokens (a stage reloading); each
    answer before must be an error, never a hang. The last answer."""
    deadline, out = time.time() + timeout, {}
    while time.time() < deadline:
        out = http_generate(server, fields)
        if "output_ids" in out:
            break
        assert out.get("error"), out
        time.sleep(1.0)
    return out


def wait_pages_free(server: Server, timeout: float = 20.0) -> dict:
    """Poll until no KV page is in use on either stage; returns the last metrics."""
    end = time.time() + timeout
    while True:
        m = metrics(server)
        used = [m.get(("pd_kv_pages_in_use", s)) for s in ("prefill", "decode")]
        if used == [0.0, 0.0] or time.time() > end:
            return m
        time.sleep(0.3)
