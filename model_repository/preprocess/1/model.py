"""Triton adapter of the preprocess stage (core: backends.stage_text.Preprocessor)."""

# ruff: noqa: E402
import os
import sys

# The python backend stub runs Python isolated (PYTHONPATH ignored): take it over by hand so the
# project and its virtual environment import (scripts/serve.sh sets PYTHONPATH).
sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p not in sys.path]

import numpy as np
import triton_python_backend_utils as pb

from backends import triton_glue as g
from backends.stage_params import from_triton_config
from backends.stage_text import Preprocessor


def _bool(v) -> bool:
    return bool(v) if not isinstance(v, str) else v.lower() in ("1", "true")


class TritonPythonModel:
    def initialize(self, args):
        g.setup_env()
        self.pre = Preprocessor(from_triton_config(args["model_config"]))

    def _one(self, request):
        s = lambda name, default, cast: g.scalar(pb, request, name, default, cast)  # noqa: E731
        r = self.pre.build(
            g.text(pb, request, "text_input"),
            s("max_tokens", None, int),
            input_ids=g.int_list(pb, request, "input_ids"),
            temperature=s("temperature", 0.0, float),
            top_p=s("top_p", 1.0, float),
            top_k=s("top_k", 0, int),
            seed=s("seed", -1, int),
            stream=s("stream", False, _bool),
            ignore_eos=s("ignore_eos", False, _bool),
            apply_chat_template=s("apply_chat_template", False, _bool),
        )
        p = r.params
        one = lambda name, v, dt: pb.Tensor(name, np.array([v], dtype=dt))  # noqa: E731
        return pb.InferenceResponse(
            output_tensors=[
                g.out_ids(pb, "PROMPT_IDS", r.prompt_ids),
                one("MAX_TOKENS", p.max_tokens, np.int32),
                one("TEMPERATURE", p.temperature, np.float32),
                one("TOP_P", p.top_p, np.float32),
                one("TOP_K", p.top_k, np.int32),
                one("SEED", -1 if p.seed is None else p.seed, np.int64),
                one("STREAM", r.stream, np.bool_),
                one("IGNORE_EOS", p.ignore_eos, np.bool_),
                one("ROOM", r.room, np.int64),
            ]
        )

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(self._one(request))
            except (ValueError, TypeError) as e:
                responses.append(g.error_response(pb, f"invalid request: {e}", invalid=True))
        return responses
