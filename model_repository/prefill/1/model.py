"""Triton adapter of the prefill stage (core: backends.stage_prefill.PrefillWorker).

Decoupled: each request is answered at once with its fields plus this instance's bootstrap
address (the ensemble starts decode from that answer), then computed by a worker thread, which
closes the request (final flag, no second response) when its KV has been handed to the sender.
"""

# ruff: noqa: E402
import os
import sys

# The python backend stub runs Python isolated (PYTHONPATH ignored): take it over by hand so the
# project and its virtual environment import (scripts/serve.sh sets PYTHONPATH).
sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p not in sys.path]

import queue
import threading

import numpy as np
import triton_python_backend_utils as pb

from backends import triton_glue as g
from backends.stage_params import from_triton_config, instance_index
from backends.stage_prefill import PrefillRequest, PrefillWorker

FIELDS = (
    "PROMPT_IDS",
    "MAX_TOKENS",
    "TEMPERATURE",
    "TOP_P",
    "TOP_K",
    "SEED",
    "STREAM",
    "IGNORE_EOS",
    "ROOM",
)
FINAL = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        g.setup_env()
        params = from_triton_config(args["model_config"])
        name = args["model_instance_name"]
        self.worker = PrefillWorker(params, instance_index=instance_index(name))
        self.addr = self.worker.bootstrap_addr
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="prefill", daemon=True)
        self.thread.start()
        self.metrics = g.StageMetrics(pb, "prefill", name, self._stats)

    def _stats(self) -> dict:
        return {**self.worker.stats(), "waiting": self.queue.qsize()}

    def _parse(self, request) -> PrefillRequest:
        params = g.sampling_params(pb, request, min_max_tokens=1)
        room = g.scalar(pb, request, "ROOM", None, int)
        return PrefillRequest(room, g.int_list(pb, request, "PROMPT_IDS"), params)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                req = self._parse(request)
            except (ValueError, TypeError) as e:
                sender.send(
                    g.error_response(pb, f"prefill: invalid request: {e}", True), flags=FINAL
                )
                continue
            outs = [pb.Tensor(f, g.get(pb, request, f)) for f in FIELDS]
            outs.append(pb.Tensor("PREFILL_ADDR", np.array([self.addr.encode()], np.object_)))
            sender.send(pb.InferenceResponse(output_tensors=outs))
            self.queue.put((req, sender))
        return None

    def _run(self):
        while True:
            item = self.queue.get()
            if item is None:
                return
            req, sender = item
            self.worker.prefill_one(req)  # errors reach the client through decode
            try:
                sender.send(flags=FINAL)
            except Exception:
                pass

    def finalize(self):
        self.queue.put(None)
        self.thread.join(timeout=10)
        self.metrics.close()
        self.worker.close()
