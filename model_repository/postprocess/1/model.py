"""Triton adapter of the postprocess stage (core: backends.stages.text.Postprocessor)."""

# ruff: noqa: E402
import os
import sys

# The python backend stub runs Python isolated (PYTHONPATH ignored): take it over by hand so the
# project and its virtual environment import (scripts/serve.sh sets PYTHONPATH).
sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p not in sys.path]

import triton_python_backend_utils as pb

from backends.stages import triton_glue as g
from backends.stages.text import Postprocessor


class TritonPythonModel:
    def initialize(self, args):
        g.setup_env()
        self.post = Postprocessor(g.stage_params(pb, args, "postprocess"))

    def _cancel(self, request):
        """The client cancelled: stop decode for this room (ensembles do not cancel the running
        decode step), and answer with an empty response (an error here leaves the 2.51
        ensemble in flight)."""
        try:
            room = int(g.get(pb, request, "ROOM").reshape(-1)[0])
            self.post.cancel(g.text(pb, request, "CANCEL_ADDR"), room)
        except Exception as e:
            pb.Logger.log_warn(f"postprocess: forwarding a cancel failed: {e}")
        empty = [g.out_text(pb, "text_output", ""), g.out_ids(pb, "output_ids", [])]
        return pb.InferenceResponse(output_tensors=empty)

    def execute(self, requests):
        responses = []
        for request in requests:
            if request.is_cancelled():
                responses.append(self._cancel(request))
                continue
            ids = g.int_list(pb, request, "OUTPUT_IDS")
            try:
                delta = self.post.text(g.int_list(pb, request, "PREFIX_IDS"), ids)
            except Exception as e:
                responses.append(g.error_response(pb, f"detokenization failed: {e}"))
                continue
            outs = [g.out_text(pb, "text_output", delta), g.out_ids(pb, "output_ids", ids)]
            responses.append(pb.InferenceResponse(output_tensors=outs))
        return responses

    def finalize(self):
        self.post.close()
