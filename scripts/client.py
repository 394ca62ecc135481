"""Ask the served ensemble a question; prints the answer as it streams.

    python scripts/client.py "What is the capital of France?"
    python scripts/client.py --http "Tell me a joke" --max-tokens 64
    python scripts/client.py --no-stream --no-chat "The three primary colors are"

gRPC streaming by default (tritonclient); ``--http`` uses the HTTP ``generate_stream`` endpoint
(``generate`` with ``--no-stream``). The chat template is applied unless ``--no-chat``.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import urllib.error
import urllib.request

import numpy as np


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("prompt")
    ap.add_argument("--url", help="server address (default 127.0.0.1:8001 gRPC, :8000 HTTP)")
    ap.add_argument("--http", action="store_true", help="HTTP generate endpoints instead of gRPC")
    ap.add_argument("--model", default="ensemble")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=-1)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--no-chat", action="store_true", help="send the prompt without chat template")
    ap.add_argument("--no-stream", action="store_true", help="one response at the end")
    ap.add_argument("--timeout", type=float, default=300.0)
    return ap.parse_args(argv)


def request_fields(args) -> dict:
    return {
        "text_input": args.prompt,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "ignore_eos": args.ignore_eos,
        "apply_chat_template": not args.no_chat,
        "stream": not args.no_stream,
    }


def run_http(args, out) -> int:
    url = f"http://{args.url or '127.0.0.1:8000'}/v2/models/{args.model}/"
    url += "generate" if args.no_stream else "generate_stream"
    body = json.dumps(request_fields(args)).encode()
    req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=args.timeout) as resp:
            if args.no_stream:
                out.write(json.loads(resp.read())["text_output"])
                return 0
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                msg = json.loads(line[5:])
                if "error" in msg:
                    print(f"\nerror: {msg['error']}", file=sys.stderr)
                    return 1
                out.write(msg["text_output"])
                out.flush()
    except urllib.error.HTTPError as e:
        print(f"error: {e.read().decode(errors='replace')}", file=sys.stderr)
        return 1
    return 0


def grpc_inputs(fields: dict):
    import tritonclient.grpc as grpcclient

    types = {
        "text_input": ("BYTES", np.object_),
        "max_tokens": ("INT32", np.int32),
        "temperature": ("FP32", np.float32),
        "top_p": ("FP32", np.float32),
        "top_k": ("INT32", np.int32),
        "seed": ("INT64", np.int64),
        "ignore_eos": ("BOOL", np.bool_),
        "apply_chat_template": ("BOOL", np.bool_),
        "stream": ("BOOL", np.bool_),
    }
    inputs = []
    for name, value in fields.items():
        dt, np_dt = types[name]
        v = value.encode() if isinstance(value, str) else value
        arr = np.array([v], dtype=np_dt)
        t = grpcclient.InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        inputs.append(t)
    return inputs


def run_grpc(args, out) -> int:
    import tritonclient.grpc as grpcclient

    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(args.url or "127.0.0.1:8001")
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer(
            args.model, grpc_inputs(request_fields(args)), enable_empty_final_response=True
        )
        while True:
            result, error = results.get(timeout=args.timeout)
            if error is not None:
                print(f"\nerror: {error}", file=sys.stderr)
                return 1
            resp = result.get_response()
            if result.as_numpy("text_output") is not None:
                out.write(result.as_numpy("text_output").reshape(-1)[0].decode())
                out.flush()
            final = resp.parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return 0
    finally:
        client.stop_stream()
        client.close()


def main(argv=None) -> int:
    args = parse_args(argv)
    rc = run_http(args, sys.stdout) if args.http else run_grpc(args, sys.stdout)
    print()
    return rc


if __name__ == "__main__":
    sys.exit(main())
