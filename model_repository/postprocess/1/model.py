"""Triton adapter of the postprocess stage (core: backends.stages.text.Postprocessor).

Decoupled, so that a decode response can produce no client response at all: a heartbeat
(``FLAGS`` = 1) or a response of a request the client cancelled gets only the final flag.
Every decode response is a new ensemble step, and only steps scheduled after a client cancel see
``is_cancelled()``: here the cancel becomes a Cancel message to the decode instance (whose
address travels with every decode response), in every phase, streaming or not.
"""

# ruff: noqa: E402
import os
import sys

# The python backend stub runs Python isolated (PYTHONPATH ignored): take it over by hand so the
# project and its virtual environment import (scripts/serve.sh sets PYTHONPATH).
sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p not in sys.path]

import triton_python_backend_utils as pb

from backends.stages import triton_glue as g
from backends.stages.text import Postprocessor

FINAL = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        g.setup_env()
        self.post = Postprocessor(g.stage_params(pb, args, "postprocess"))
        self.retirement = g.Retirement(args["model_instance_name"])

    def _forward_cancel(self, request) -> None:
        try:
            room = int(g.get(pb, request, "ROOM").reshape(-1)[0])
            self.post.cancel(g.text(pb, request, "CANCEL_ADDR"), room)
        except Exception as e:
            pb.Logger.log_warn(f"postprocess: forwarding a cancel failed: {e}")

    def _respond(self, request):
        ids = g.int_list(pb, request, "OUTPUT_IDS")
        try:
            delta = self.post.text(g.int_list(pb, request, "PREFIX_IDS"), ids)
        except Exception as e:
            return g.error_response(pb, f"detokenization failed: {e}")
        outs = [g.out_text(pb, "text_output", delta), g.out_ids(pb, "output_ids", ids)]
        return pb.InferenceResponse(output_tensors=outs)

    def execute(self, requests):
        with self.retirement:  # a replaced version exits only between batches
            for request in requests:
                sender = request.get_response_sender()
                if request.is_cancelled():
                    self._forward_cancel(request)
                    sender.send(flags=FINAL)
                elif g.int_list(pb, request, "FLAGS") == [1]:  # a heartbeat: nothing for the client
                    sender.send(flags=FINAL)
                else:
                    sender.send(self._respond(request), flags=FINAL)
            return None

    def finalize(self):
        self.post.close()
