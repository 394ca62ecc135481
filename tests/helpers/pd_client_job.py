"""Run a batch of ensemble requests concurrently over gRPC and print the results as JSON (run
inside a test bed's network namespace by the multi-host tests).

    python pd_client_job.py URL JOBS.json  # [{"text", "max_tokens", "stream"[, "chat"]}, ...]
prints [{"ids": [...], "text": "...", "error": null | "..."}, ...] in job order.
"""

from __future__ import annotations

import json
import sys
import threading

from triton_harness import grpc_ask  # beside this file: the script's directory is on the path


def main() -> None:
    url, path = sys.argv[1], sys.argv[2]
    with open(path) as f:
        jobs = json.load(f)
    out: list[dict] = [{} for _ in jobs]

    def run(i: int, job: dict) -> None:
        fields = {
            "text_input": job["text"],
            "max_tokens": job["max_tokens"],
            "apply_chat_template": job.get("chat", True),
            "stream": job["stream"],
        }
        try:
            pieces, ids, err = grpc_ask(url, fields, timeout=180)
            out[i] = {"ids": ids, "text": "".join(pieces), "error": err}
        except Exception as e:  # noqa: BLE001 - reported, the test fails on it
            out[i] = {"ids": [], "text": "", "error": f"client: {e}"}

    threads = [threading.Thread(target=run, args=(i, j)) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
