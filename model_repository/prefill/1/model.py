"""Triton adapter of the prefill stage (core: backends.stages.prefill.PrefillWorker).

Decoupled: each request is queued with the worker (which computes it once decode registered its
pages) and answered at once by the request carrying this instance's bootstrap address (the
ensemble starts decode from that answer). A request the worker refuses (invalid, or overloaded:
its queue is full) gets that error at once. Errors after the answer reach the client through
decode, whose step stays open until the request ends.

In the ensemble the answer is final: an open prefill step outliving a failed decode step (decode
refused the request, or failed it while prefill computed) left the ensemble request in flight for
good in Triton 2.51, whose ensemble ignores a step's closing flag once another step failed; a
cancel reaches prefill through decode (its heartbeats, then its abort). A request forwarded by
another server's router (backends/stages/router/client.py: ``HOLD_PARAM``) is held open until
the worker is done with the room instead, so that a server dying mid-room breaks that call.
"""

# ruff: noqa: E402
import os
import sys

# The python backend stub runs Python isolated (PYTHONPATH ignored): take it over by hand so the
# project and its virtual environment import (scripts/serve.sh sets PYTHONPATH).
sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p not in sys.path]

import json

import triton_python_backend_utils as pb

from backends.stages import triton_glue as g
from backends.stages.fingerprint import ForwardCheck, info_labels
from backends.stages.params import instance_index
from backends.stages.prefill import PrefillWorker
from backends.stages.request import HOLD_PARAM

FINAL = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        g.setup_env()
        name = args["model_instance_name"]
        params = g.stage_params(pb, args, "prefill")
        self.worker = PrefillWorker(params, instance_index=instance_index(name))
        # a forwarded request carries its router's deployment fingerprint: refuse another one
        self.identity = ForwardCheck(self.worker.sender.fingerprint)
        fp = self.identity.mine
        info = info_labels(fp) if fp else None
        self.metrics = g.StageMetrics(
            pb, "prefill", name, self._stats, info=info, observations=self.worker.latency
        )
        self.retirement = g.Retirement(name, self.worker.idle)
        # tensor parallel: a dead rank ends this process; the supervisor loads the stage again
        g.exit_when_a_rank_dies(name, self.worker.runner, self.worker.draft)
        g.started()

    def _submit(self, request, sender) -> None:
        params = request.parameters()
        self.identity.check(params)
        hold = json.loads(params or "{}").get(HOLD_PARAM) is True
        req = g.stage_request(pb, request).with_bootstrap(self.worker.bootstrap_addr)
        self.worker.submit(req, (lambda _result: sender.send(flags=FINAL)) if hold else None)
        answer = pb.InferenceResponse(output_tensors=[g.request_tensor(pb, req)])
        sender.send(answer, flags=0 if hold else FINAL)

    def execute(self, requests):
        with self.retirement:  # a replaced version exits only between batches
            g.answer_each(pb, requests, "prefill", self._submit)
        return None

    def _stats(self) -> dict:
        ready = int(self.worker.sender.alive)  # its KV endpoint is bound and served
        return self.identity.merged({**self.worker.stats(), "ready": ready})

    def finalize(self):
        self.metrics.close()
        self.worker.close()
