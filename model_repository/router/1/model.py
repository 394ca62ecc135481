"""Triton adapter of the prefill router (core: backends.stages.router.PrefillRouter).

Decoupled, like the prefill model it stands in for: each request is forwarded (on the router's
threads) and answered with the prefill server's answer, the request carrying its bootstrap
address, as its one and final response. The router step never waits for the prefill server to
finish the room: a server that hangs after its answer must not hold the client's request open;
decode alone watches the room and re-dispatches it (backends/stages/decode/failover.py). No
server left: the error names each one's reason.
"""

# ruff: noqa: E402
import os
import sys

# The python backend stub runs Python isolated (PYTHONPATH ignored): take it over by hand so the
# project and its virtual environment import (scripts/serve.sh sets PYTHONPATH).
sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p not in sys.path]

import triton_python_backend_utils as pb

from backends.stages import triton_glue as g
from backends.stages.fingerprint import stage_fingerprint
from backends.stages.prefix import caches
from backends.stages.router import PrefillRouter, RouterMetrics

FINAL = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        g.setup_env()
        name = args["model_instance_name"]
        p = g.stage_params(pb, args, "router")
        self.router = PrefillRouter(
            p.servers(), p.route_timeout_s, p.probe_interval_s, name,
            local_max_tokens=p.local_prefill_max_tokens,
            local_busy_tokens=p.local_prefill_busy_tokens,
            fingerprint=stage_fingerprint(p),  # prefill servers of another deployment: refused
            page_size=p.page_size, route_policy=p.route_policy, decode_caches=caches(p),
        )  # fmt: skip
        self.metrics = RouterMetrics(pb, "router", name, self.router)
        self.stage_metrics = g.StageMetrics(pb, "router", name, self.router.stage_stats)
        self.retirement = g.Retirement(name)
        g.started()

    def _route(self, request, sender) -> None:
        req = g.stage_request(pb, request)

        def routed(r):  # final at once: decode alone waits for the prefill server from here
            sender.send(pb.InferenceResponse(output_tensors=[g.request_tensor(pb, r)]), flags=FINAL)

        def failed(e):
            sender.send(g.exception_response(pb, "prefill router", e), flags=FINAL)

        self.router.submit(req, routed, failed)

    def execute(self, requests):
        with self.retirement:  # a replaced version exits only between batches
            g.answer_each(pb, requests, "prefill router", self._route)
        return None

    def finalize(self):
        self.stage_metrics.close()
        self.metrics.close()
        self.router.close()
