"""``python -m backends.openai --port 9000 --grpc-url 127.0.0.1:8001 --model-name NAME``
(``--api-key-file FILE`` for API keys: required when ``--host`` is not loopback)."""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import uvicorn

from .app import create_app
from .auth import NO_KEY_ENV, check_binding, load_keys
from .limits import body_limit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on")
    ap.add_argument("--port", type=int, default=9000)
    ap.add_argument("--grpc-url", default="127.0.0.1:8001", help="the server's Triton gRPC port")
    ap.add_argument(
        "--model-name",
        action="append",
        default=[],
        help="name(s) clients use for the model (default: the checkpoint directory's"
        " name, and 'ensemble')",
    )
    ap.add_argument("--model-dir", default="models/smollm2-135m-instruct")
    ap.add_argument("--ensemble", default="ensemble", help="the Triton model to call")
    ap.add_argument(
        "--max-inflight",
        type=int,
        default=4096,
        help="requests at once; past it new ones get 503 with Retry-After",
    )
    ap.add_argument(
        "--retry-window",
        type=float,
        default=30.0,
        help="seconds within which a request that Triton itself failed before any token (a"
        " stage process that died, until the supervisor reloads it) is tried again; 0: never",
    )
    ap.add_argument(
        "--server-pid",
        type=int,
        default=0,
        help="exit when this process (the tritonserver) is gone",
    )
    ap.add_argument(
        "--api-key-file",
        default=None,
        help="API keys, one a line (default: $PD_API_KEY_FILE; $PD_API_KEY adds one); clients"
        " send 'Authorization: Bearer KEY' on every /v1 route",
    )
    ap.add_argument(
        "--insecure-no-api-key",
        action="store_true",
        default=os.environ.get(NO_KEY_ENV, "") == "1",
        help=f"serve a non-loopback --host without an API key (${NO_KEY_ENV}=1)",
    )
    ap.add_argument(
        "--max-body-bytes",
        type=int,
        default=int(os.environ.get("PD_MAX_BODY_BYTES", "0")),
        help="request body limit; past it a 413 before the body is parsed (default"
        " $PD_MAX_BODY_BYTES, else 4 MiB or 64 bytes a --max-context token, the larger)",
    )
    ap.add_argument(
        "--max-context", type=int, default=0, help="the server's max_context (the body limit)"
    )
    ap.add_argument(
        "--check-config",
        action="store_true",
        help="check the API keys and the address, then exit (serve.sh does it before it starts)",
    )
    a = ap.parse_args()
    try:
        keys = load_keys(a.api_key_file)
        check_binding(a.host, keys, a.insecure_no_api_key)
    except (OSError, ValueError) as e:
        print(f"backends.openai: {e}", file=sys.stderr)
        sys.exit(2)
    if a.check_config:
        return
    if a.server_pid:
        threading.Thread(target=_exit_with, args=(a.server_pid,), daemon=True).start()
    names = tuple(a.model_name) or (os.path.basename(a.model_dir.rstrip("/")), a.ensemble)
    limit = body_limit(a.max_body_bytes, a.max_context)
    app = create_app(a.grpc_url, names, a.ensemble, a.max_inflight, keys, limit, a.retry_window)
    uvicorn.run(app, host=a.host, port=a.port, log_level="warning", access_log=False)


def _exit_with(pid: int) -> None:
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            os._exit(0)
        except PermissionError:
            pass
        time.sleep(1.0)


if __name__ == "__main__":
    main()
