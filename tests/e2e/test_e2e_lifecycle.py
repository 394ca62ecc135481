"""A server's life: a stage process that dies (SIGKILL, as the OOM killer would) is reloaded by
serve.sh's supervisor and serves the same tokens again (decode here; a prefill stage process that
exits after its TP rank died: test_e2e_tp.py); stopping a server with serve.sh --stop
during long requests ends the whole process tree within its bounded wait and the clients get an
error, not a hang; a tritonserver killed outright takes its stage processes with it."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import proc_net
import pytest
from triton_harness import GrpcStream, grpc_input, http_generate, launch, stop, until_served

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

STOP_TIMEOUT = 10


def long_request(server, stream: bool, out: dict) -> threading.Thread:
    def run():
        s = GrpcStream(server.grpc)
        fields = {"text_input": "Tell me a long story.", "max_tokens": 1000, "ignore_eos": True}
        t0 = time.time()
        out[stream] = s.ask(
            [grpc_input(k, v) for k, v in {**fields, "stream": stream}.items()], 180
        )
        out[f"{stream}_s"] = time.time() - t0

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _stub(pgid: int, stage: str) -> int:
    pid = proc_net.stage_stub(pgid, stage)
    assert pid is not None, f"no {stage} stub process"
    return pid


def test_a_killed_stage_process_is_reloaded_and_serves_the_same_tokens(tmp_path, reference):
    srv, serve, env = launch(tmp_path, [])
    try:
        fields = {"text_input": "The capital of France is", "max_tokens": 12}
        want = reference.greedy(fields["text_input"], False, 12)
        assert http_generate(srv, fields)["output_ids"] == want
        for stage in ("decode",):  # prefill's stub dying and reloading: test_e2e_tp.py
            victim = _stub(srv.pid, stage)
            os.kill(victim, signal.SIGKILL)
            out = until_served(srv, fields, 120)  # errors meanwhile (stub dead, reloading)
            assert out.get("output_ids") == want, (stage, out)
            assert _stub(srv.pid, stage) != victim
        with open(srv.log, errors="replace") as f:
            log = f.read()
        assert log.count("[supervise]") >= 2 and "model decode reloaded" in log
    finally:
        stop(srv, serve, env, timeout_s=5)  # a dead version lingers


def test_stop_during_long_requests_leaves_no_process_and_errors_the_clients(tmp_path):
    srv, serve, env = launch(tmp_path, ["max_context=2048", "max_tokens_limit=1024"])
    pgid = srv.pid
    assert len(proc_net.group(pgid)) >= 5  # tritonserver and its stage processes
    out: dict = {}
    threads = [long_request(srv, True, out), long_request(srv, False, out)]
    time.sleep(6.0)  # both are decoding
    port = srv.http.rsplit(":", 1)[1]
    t0 = time.time()
    cmd = [serve[0], "--stop", "--http-port", port, "--stop-timeout", str(STOP_TIMEOUT)]
    subprocess.run(cmd, env=env, timeout=STOP_TIMEOUT + 30, check=True)
    assert time.time() - t0 < STOP_TIMEOUT + 15  # the bounded wait (+ the group kill)
    assert proc_net.group(pgid) == []  # the whole tree is gone, no orphan
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a client hangs"
    for stream in (True, False):
        pieces, ids, err = out[stream]
        assert err is not None and len(ids) < 1000, (stream, err)


def test_stage_processes_exit_when_their_server_is_killed(tmp_path):
    srv, serve, env = launch(tmp_path, [])
    pgid = srv.pid
    stages = [p for p in proc_net.group(pgid) if p != pgid]
    assert len(stages) >= 4
    os.kill(pgid, signal.SIGKILL)  # no serve.sh, no clean shutdown
    deadline = time.time() + 15
    while [p for p in stages if p in proc_net.group(pgid)]:
        assert time.time() < deadline, f"orphaned stage processes: {proc_net.group(pgid)}"
        time.sleep(0.5)
    pidfile = os.path.join(
        os.path.dirname(srv.log), f"tritonserver-{srv.http.rsplit(':', 1)[1]}.pid"
    )
    if os.path.exists(pidfile):
        os.remove(pidfile)
