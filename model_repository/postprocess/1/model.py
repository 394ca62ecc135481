"""Triton adapter of the postprocess stage (core: backends.stages.text.Postprocessor).

Decoupled, so that a decode response can produce no client response at all: a heartbeat or a
response of a request the client cancelled gets only the final flag. Decode detokenizes (it
cuts stop strings); here each ``RESPONSE`` becomes the client outputs (logprobs as JSON).
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
        g.started()

    def _forward_cancel(self, res) -> None:
        try:
            self.post.cancel(res.cancel_addr, res.room)
        except Exception as e:
            pb.Logger.log_warn(f"postprocess: forwarding a cancel failed: {e}")

    def _respond(self, res):
        try:
            outs = [pb.Tensor(k, v) for k, v in self.post.outputs(res).items()]
        except Exception as e:
            return g.error_response(pb, f"postprocess failed: {e}")
        return pb.InferenceResponse(output_tensors=outs)

    def execute(self, requests):
        with self.retirement:  # a replaced version exits only between batches
            for request in requests:
                sender = request.get_response_sender()
                try:
                    res = g.stage_response(pb, request)
                except ValueError as e:
                    sender.send(g.error_response(pb, f"postprocess: {e}"), flags=FINAL)
                    continue
                if request.is_cancelled():
                    self._forward_cancel(res)
                    sender.send(flags=FINAL)
                elif res.heartbeat:  # nothing for the client
                    sender.send(flags=FINAL)
                else:
                    sender.send(self._respond(res), flags=FINAL)
            return None

    def finalize(self):
        self.post.close()
