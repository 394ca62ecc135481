"""How the Triton glue answers a decoupled model's batch (``backends/stages/triton_glue.py``),
with a stand-in for ``triton_python_backend_utils``: each request's failure is its own, and a
request whose client is gone (its response sender closed) never leaves the others unanswered."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

from backends.stages import errors
from backends.stages import triton_glue as g


class FakePb:
    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    class TritonError:
        INVALID_ARG, UNAVAILABLE, INTERNAL = "INVALID_ARG", "UNAVAILABLE", "INTERNAL"

        def __init__(self, message, code):
            self.message, self.code = message, code

    class InferenceResponse:
        def __init__(self, output_tensors, error=None):
            self.output_tensors, self.error = output_tensors, error


class SenderClosed(Exception):
    """What a closed response sender raises (Triton: "Response sender has been closed")."""


class FakeSender:
    def __init__(self, closed: bool = False):
        self.closed, self.sent = closed, []

    def send(self, response=None, flags=0):
        if self.closed:
            raise SenderClosed("Unable to send response. Response sender has been closed.")
        self.sent.append((response, flags))


class FakeRequest:
    def __init__(self, name: str, sender: FakeSender):
        self.name, self.sender = name, sender

    def get_response_sender(self):
        return self.sender


def test_a_closed_response_sender_never_leaves_the_rest_of_the_batch_unanswered(caplog):
    gone = FakeRequest("gone", FakeSender(closed=True))  # its client left: every send raises
    busy = FakeRequest("busy", FakeSender())
    fine = FakeRequest("fine", FakeSender())
    handled = []

    def handle(request, sender):
        handled.append(request.name)
        if request.name == "busy":
            raise errors.Overloaded("queue full")
        sender.send(f"answer of {request.name}", flags=FakePb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    with caplog.at_level(logging.WARNING, logger=g.__name__):
        g.answer_each(FakePb, [gone, busy, fine], "prefill", handle)
    assert handled == ["gone", "busy", "fine"]
    ((err, flags),) = busy.sender.sent  # its own error, final
    assert flags == FakePb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    assert err.error.code == FakePb.TritonError.UNAVAILABLE and "queue full" in err.error.message
    assert fine.sender.sent == [("answer of fine", FakePb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)]
    said = [r.getMessage() for r in caplog.records if r.name == g.__name__]
    assert len(said) == 1 and "Response sender has been closed" in said[0]


def test_a_stage_process_logs_with_time_level_and_pid():
    """setup_env's log_to_stderr: a stage's warning in the server log carries Triton's line
    shape (was: the bare message, no time to place a failover's lines against Triton's)."""
    code = (
        "import logging\n"
        "from backends.stages import triton_glue as g\n"
        "g.log_to_stderr()\n"
        "logging.getLogger('backends.stages.router.router').warning('router: %s up', 'p2')\n"
        "logging.getLogger('x').info('not shown')\n"
        "import os; print(os.getpid())\n"
    )
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    env = dict(os.environ, PYTHONPATH=os.path.abspath(root))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)  # fmt: skip
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    shape = r"W\d{4} \d\d:\d\d:\d\d\.\d{3} (\d+) backends\.stages\.router\.router\] router: p2 up"
    m = re.fullmatch(shape, lines[0])
    assert m and m.group(1) == out.stdout.strip(), lines[0]
