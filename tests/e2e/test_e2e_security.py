"""Secure by default, checked on a running server: every listener of every process of the
server is on its configured host, control messages must carry the per-start secret, and model
management needs the per-start admin key."""

from __future__ import annotations

import os
import time
import urllib.error
import urllib.request

import proc_net
import pytest
import zmq
from triton_harness import metrics

from kvtransfer import messages as m

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
HOST = "127.0.0.1"  # serve.sh's default for Triton's ports and the stages' bootstrap_host


def _cmd(pid: int) -> str:
    return proc_net.cmdline(pid).replace(b"\0", b" ").decode(errors="replace")


def _stages(server) -> dict[str, list[int]]:
    stubs = [p for p in proc_net.tree(server.pid) if "triton_python_backend_stub" in _cmd(p)]
    out: dict[str, list[int]] = {}
    for p in stubs:
        stage = next(
            s for s in ("preprocess", "prefill", "decode", "postprocess") if f"/{s}/" in _cmd(p)
        )
        out.setdefault(stage, []).append(p)
    return out


def test_every_listener_of_every_server_process_is_on_the_configured_host(server):
    stages = _stages(server)
    assert len(stages["prefill"]) == 2 and len(stages["decode"]) == 2  # the session server
    found = proc_net.listeners(proc_net.tree(server.pid))
    bad = [x for x in found if not proc_net.is_on(x[1], HOST)]
    assert found and not bad, f"listening beyond {HOST}: {bad}"
    for stage in ("prefill", "decode"):  # zmq control + Mooncake data plane + handshake
        for pid in stages[stage]:
            assert len([x for x in found if x[0] == pid]) >= 3, (stage, found)


def test_control_messages_need_the_per_start_secret(server):
    before = metrics(server).get(("pd_dropped_frames_total", "prefill"), 0.0)
    prefill = _stages(server)["prefill"][0]
    ports = [port for pid, _, port in proc_net.listeners([prefill]) if not 15000 <= port <= 17000]
    assert ports, "the prefill stage's control socket"
    ctx = zmq.Context()
    try:
        for port in ports:  # an unsigned Ping, as a peer without the secret would send it
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"tcp://{HOST}:{port}")
            s.send(m.encode(m.Ping(1)))
            assert not s.poll(1500), "answered an unsigned message"
            s.close()
    finally:  # not ctx.term(): a socket left open by a failed assert would block it forever
        ctx.destroy(linger=0)
    deadline = time.time() + 5
    while metrics(server).get(("pd_dropped_frames_total", "prefill"), 0.0) <= before:
        assert time.time() < deadline, "the unsigned frame was not counted as dropped"
        time.sleep(0.3)


def test_model_management_needs_the_per_start_admin_key(server):
    """Loading/unloading models, shared memory, trace and log settings are behind a random key
    per start (only the operator's run directory has it); inference stays open."""
    port = server.http.rsplit(":", 1)[1]
    with open(os.path.join(os.path.dirname(server.log), f"admin-key-{port}")) as f:
        key = f.read().strip()
    for path in ("/v2/repository/index", "/v2/repository/models/prefill/unload"):
        code, body = _post(server, path, {})
        assert code == 403 and "restricted" in body, (path, code, body)
        code, body = _post(server, path, {"pd-admin-key": "not-the-key"})
        assert code == 403, (path, code, body)
    code, body = _post(server, "/v2/repository/index", {"pd-admin-key": key})
    assert code == 200 and '"prefill"' in body, body
    code, _ = _post(server, "/v2/systemsharedmemory/status", {}, "GET")
    assert code == 403
    assert (
        os.stat(os.path.join(os.path.dirname(server.log), f"admin-key-{port}")).st_mode & 0o077 == 0
    )


def _post(server, path: str, headers: dict, method: str = "POST") -> tuple[int, str]:
    data = b"" if method == "POST" else None
    req = urllib.request.Request(f"http://{server.http}{path}", data, headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
