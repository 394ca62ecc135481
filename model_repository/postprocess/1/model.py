"""Triton adapter of the postprocess stage: token ids -> the text they add."""

# ruff: noqa: E402
import os
import sys

# The python backend stub runs Python isolated (PYTHONPATH ignored): take it over by hand so the
# project and its virtual environment import (scripts/serve.sh sets PYTHONPATH).
sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p not in sys.path]

import triton_python_backend_utils as pb

from backends import triton_glue as g
from backends.cancel_channel import CancelSender
from backends.stage_params import from_triton_config
from backends.stage_text import text_delta
from backends.tokenizer import Tokenizer


class TritonPythonModel:
    def initialize(self, args):
        g.setup_env()
        params = from_triton_config(args["model_config"])
        self.tok = Tokenizer(params.model_path)
        self.cancels = CancelSender(params.shared_secret.encode() or None)

    def execute(self, requests):
        responses = []
        for request in requests:
            if request.is_cancelled():  # the client cancelled: stop decode for this room
                try:
                    room = g.scalar(pb, request, "ROOM", None, int)
                    self.cancels.cancel(g.text(pb, request, "CANCEL_ADDR"), room)
                except Exception as e:
                    pb.Logger.log_warn(f"postprocess: forwarding a cancel failed: {e}")
                # a normal (empty) response: an error here leaves the 2.51 ensemble in flight
                empty = [g.out_text(pb, "text_output", ""), g.out_ids(pb, "output_ids", [])]
                responses.append(pb.InferenceResponse(output_tensors=empty))
                continue
            ids = g.int_list(pb, request, "OUTPUT_IDS")
            prefix = g.int_list(pb, request, "PREFIX_IDS")
            try:
                delta = text_delta(self.tok, prefix, ids)
            except Exception as e:
                responses.append(g.error_response(pb, f"detokenization failed: {e}"))
                continue
            outs = [g.out_text(pb, "text_output", delta), g.out_ids(pb, "output_ids", ids)]
            responses.append(pb.InferenceResponse(output_tensors=outs))
        return responses

    def finalize(self):
        self.cancels.close()
