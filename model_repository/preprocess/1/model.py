"""Triton adapter of the preprocess stage (core: backends.stages.text.Preprocessor)."""

# ruff: noqa: E402
import os
import sys

# The python backend stub runs Python isolated (PYTHONPATH ignored): take it over by hand so the
# project and its virtual environment import (scripts/serve.sh sets PYTHONPATH).
sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p not in sys.path]

import triton_python_backend_utils as pb

from backends.stages import triton_glue as g
from backends.stages.text import Preprocessor


class TritonPythonModel:
    def initialize(self, args):
        g.setup_env()
        self.pre = Preprocessor(g.stage_params(pb, args, "preprocess"))
        self.retirement = g.Retirement(args["model_instance_name"])
        g.started()

    def execute(self, requests):
        with self.retirement:  # a replaced version exits only between batches
            responses = []
            for request in requests:
                try:
                    req = self.pre.build(g.inputs(pb, request))
                    responses.append(
                        pb.InferenceResponse(output_tensors=[g.request_tensor(pb, req)])
                    )
                except Exception as e:
                    responses.append(g.exception_response(pb, "preprocess", e))
            return responses
