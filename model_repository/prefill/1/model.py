"""Triton adapter of the prefill stage (core: backends.stages.prefill.PrefillWorker).

Decoupled: each request is answered at once with the request carrying this instance's bootstrap
address (the ensemble starts decode from that answer), then submitted to the worker's compute
thread, which closes the request (final flag, no second response) when its KV has been handed to
the sender. Errors reach the client through decode (the room fails there).
"""

# ruff: noqa: E402
import os
import sys

# The python backend stub runs Python isolated (PYTHONPATH ignored): take it over by hand so the
# project and its virtual environment import (scripts/serve.sh sets PYTHONPATH).
sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p not in sys.path]

import triton_python_backend_utils as pb

from backends.stages import triton_glue as g
from backends.stages.params import instance_index
from backends.stages.prefill import PrefillWorker

FINAL = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        g.setup_env()
        name = args["model_instance_name"]
        params = g.stage_params(pb, args, "prefill")
        self.worker = PrefillWorker(params, instance_index=instance_index(name))
        self.metrics = g.StageMetrics(pb, "prefill", name, self.worker.stats)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                req = g.stage_request(pb, request).with_bootstrap(self.worker.bootstrap_addr)
            except ValueError as e:
                error = g.error_response(pb, f"prefill: invalid request: {e}", True)
                sender.send(error, flags=FINAL)
                continue
            sender.send(pb.InferenceResponse(output_tensors=[g.request_tensor(pb, req)]))
            self.worker.submit(req, lambda _result, s=sender: s.send(flags=FINAL))
        return None

    def finalize(self):
        self.metrics.close()
        self.worker.close()
