"""``python -m backends.openai --port 9000 --grpc-url 127.0.0.1:8001 --model-name NAME``."""

from __future__ import annotations

import argparse
import os
import threading
import time

import uvicorn

from .app import create_app


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
        "--server-pid",
        type=int,
        default=0,
        help="exit when this process (the tritonserver) is gone",
    )
    a = ap.parse_args()
    if a.server_pid:
        threading.Thread(target=_exit_with, args=(a.server_pid,), daemon=True).start()
    names = tuple(a.model_name) or (os.path.basename(a.model_dir.rstrip("/")), a.ensemble)
    app = create_app(a.grpc_url, names, a.ensemble, a.max_inflight)
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
