"""Triton adapter of the decode stage (core: backends.stages.decode.DecodeWorker).

Decoupled: ``execute`` only parses and submits; the worker's loop thread answers through each
request's response sender (one response per step when streaming, one at the end otherwise).
Each response is one ``RESPONSE`` tensor (backends/stages/request.py: text, token ids, logprobs,
finish reason). While a request has nothing to send it gets a heartbeat response (no tokens)
every 0.25 s: Triton ensembles cancel only the steps they schedule after a client cancel, so
each heartbeat gives postprocess a new step that sees the cancel and tells decode (postprocess
answers a heartbeat with no response, so the client never sees one).
"""

# ruff: noqa: E402
import os
import sys

# The python backend stub runs Python isolated (PYTHONPATH ignored): take it over by hand so the
# project and its virtual environment import (scripts/serve.sh sets PYTHONPATH).
sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p not in sys.path]

import triton_python_backend_utils as pb

from backends.stages import triton_glue as g
from backends.stages.decode import DecodeEvent, DecodeWorker
from backends.stages.request import StageResponse

FINAL = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _emitter(sender, req, cancel_addr: str):
    def emit(ev: DecodeEvent) -> None:
        if ev.error:
            sender.send(g.error_response(pb, ev.error, ev.error_kind), flags=FINAL)
            return
        if ev.finish_reason == "cancelled":
            sender.send(flags=FINAL)
            return
        res = StageResponse(
            room=req.room, cancel_addr=cancel_addr, heartbeat=ev.heartbeat, text=ev.text,
            token_ids=ev.token_ids, logprobs=ev.logprobs, num_input_tokens=len(req.prompt_ids),
            num_cached_tokens=ev.cached_tokens, finish_reason=ev.finish_reason or "",
        )  # fmt: skip
        response = pb.InferenceResponse(output_tensors=[g.response_tensor(pb, res)])
        sender.send(response, flags=FINAL if ev.final else 0)

    return emit


class TritonPythonModel:
    def initialize(self, args):
        g.setup_env()
        self.worker = DecodeWorker(g.stage_params(pb, args, "decode"))
        self.metrics = g.StageMetrics(
            pb, "decode", args["model_instance_name"], self.worker.stats,
            observations=self.worker.latency,
        )  # fmt: skip
        self.retirement = g.Retirement(args["model_instance_name"], self.worker.idle)
        # tensor parallel: a dead rank ends this process; the supervisor loads the stage again
        name = args["model_instance_name"]
        g.exit_when_a_rank_dies(name, self.worker.runner, self.worker.draft)
        g.started()

    def _submit(self, request, sender) -> None:
        req = g.stage_request(pb, request)
        emit = _emitter(sender, req, self.worker.cancel_addr)
        self.worker.submit(req, emit, sender.is_cancelled)

    def execute(self, requests):
        with self.retirement:  # a replaced version exits only between batches
            g.answer_each(pb, requests, "decode", self._submit)
        return None

    def finalize(self):
        self.metrics.close()
        self.worker.close()
