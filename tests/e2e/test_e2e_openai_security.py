"""The OpenAI front as an internet-facing service, against a real tritonserver (serve.sh with
``$PD_API_KEY_FILE``) and the official ``openai`` SDK: 401 without the key or with a wrong one,
200 with it, /health open; 400s naming each out-of-range field (the values that used to wrap
among them) and the server's own limits; a 413 before the body is sent; a 400 for deep nesting.
Last, tritonserver is killed under a front that outlives it: each stream in flight ends with
an error event and ``[DONE]`` (the SDK raises the server's message), and later requests get a
503 with ``Retry-After`` in OpenAI's shape."""

from __future__ import annotations

import http.client
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import openai
import pytest
from triton_harness import ROOT, free_port, launch, stop

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
NAME = "smollm2-135m-instruct"
KEY = secrets.token_hex(32)
LIMIT = 256  # max_tokens_limit
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("openai-security")
    keys = tmp / "api-keys"
    keys.write_text(f"# the front's keys\n{KEY}\n")
    sets = ["num_pages=128", "max_context=512", f"max_tokens_limit={LIMIT}"]
    srv, serve, env = launch(tmp, sets, env={"PD_API_KEY_FILE": str(keys)})
    # a second front on the same Triton, not tied to its pid: it outlives a killed tritonserver
    port = free_port()
    cmd = [sys.executable, "-m", "backends.openai", "--port", str(port), "--grpc-url", srv.grpc,
           "--model-name", NAME, "--api-key-file", str(keys)]  # fmt: skip
    with open(tmp / "front.log", "w") as log:
        front = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while not _answers(url + "/health"):
        assert front.poll() is None and time.time() < deadline, (tmp / "front.log").read_text()
        time.sleep(0.25)
    yield srv, url + "/v1"
    front.terminate()
    front.wait(10)
    stop(srv, serve, env, timeout_s=10)


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=5).close()
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True


def sdk(base: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=120)


def raw(base: str, method: str, path: str, body: bytes = b"", headers=AUTH):
    """(status, headers, parsed JSON body) of one request to the front at ``base`` (…/v1)."""
    u = urllib.parse.urlparse(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request(method, u.path + path, body, {"Content-Type": "application/json", **headers})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, r.headers, json.loads(data) if data else None


def test_the_key_is_required_and_health_stays_open(deployment):
    srv, _ = deployment
    status, headers, body = raw(srv.openai, "GET", "/models", headers={})
    assert status == 401 and body["error"]["code"] == "missing_api_key"
    assert headers["WWW-Authenticate"] == "Bearer"
    with pytest.raises(openai.AuthenticationError) as e:
        sdk(srv.openai, secrets.token_hex(32)).models.list()
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    assert e.value.body["message"] == "invalid API key"  # the server's own message
    with pytest.raises(openai.AuthenticationError):
        sdk(srv.openai, KEY[:-1]).completions.create(model=NAME, prompt="Hi", max_tokens=2)
    r = sdk(srv.openai).completions.create(model=NAME, prompt="The capital of France is",
                                          max_tokens=3)  # fmt: skip
    assert r.usage.completion_tokens == 3
    u = urllib.parse.urlparse(srv.openai)
    with urllib.request.urlopen(f"http://{u.hostname}:{u.port}/health", timeout=10) as h:
        assert h.status == 200


CASES = [  # (create kwargs, the param the 400 names, words of the message)
    ({"max_tokens": 2**32 + 5}, "max_tokens", ["max_tokens"]),  # used to run as 5
    ({"extra_body": {"top_k": 2**32 + 3}}, "top_k", ["top_k"]),  # used to run as 3
    ({"prompt": [2**32 + 1, 15]}, "prompt", ["prompt[0]"]),  # used to run as [1, 15]
    ({"max_tokens": LIMIT + 1}, "max_tokens", [str(LIMIT), "max_tokens_limit"]),  # the server's
    ({"prompt": [1, 99999999]}, "prompt", ["vocabulary"]),  # preprocess: the vocabulary
    ({"extra_body": {"stop_token_ids": [99999999]}}, "stop_token_ids", ["vocabulary"]),
    ({"prompt": [15] * 400, "max_tokens": 200}, "max_tokens", ["context limit"]),
]


@pytest.mark.parametrize(("kw", "param", "words"), CASES, ids=[c[1] for c in CASES])
def test_out_of_range_fields_are_400s_naming_them(deployment, kw, param, words):
    srv, _ = deployment
    client = sdk(srv.openai)
    body = {"model": NAME, "prompt": "Hello", "max_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**body)
    err = e.value.body
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert err["code"] and "[pd-error" not in err["message"], err
    for w in words:
        assert w in err["message"], err
    if "context limit" in words:
        assert err["code"] == "context_length_exceeded"
    assert client.completions.create(model=NAME, prompt="Hello", max_tokens=2).choices[0].text


def test_an_oversized_body_is_a_413_before_it_is_sent(deployment):
    srv, _ = deployment
    u = urllib.parse.urlparse(srv.openai)
    for auth, status in ((f"Bearer {KEY}", 413), (None, 401)):  # the key comes first
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        conn.putrequest("POST", u.path + "/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(10**9))  # a gigabyte announced, never sent
        if auth:
            conn.putheader("Authorization", auth)
        conn.endheaders()
        r = conn.getresponse()
        body = json.loads(r.read())
        conn.close()
        assert r.status == status, body
        assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["code"]


def test_deep_nesting_is_a_400(deployment):
    srv, _ = deployment
    deep = b'{"model": "m", "prompt": "x", "x": ' + b"[" * 50000 + b"]" * 50000 + b"}"
    status, _, body = raw(srv.openai, "POST", "/completions", deep)
    assert status == 400 and "nests deeper" in body["error"]["message"]


def test_triton_killed_under_the_front(deployment):
    """Two streams in flight when tritonserver dies: the raw one ends with an error event and
    [DONE], the SDK's raises the server's message; then requests get a 503 with Retry-After."""
    srv, front = deployment
    started = [threading.Event(), threading.Event()]
    results: dict = {}
    body = {"model": NAME, "prompt": "Count from one to a thousand:", "max_tokens": LIMIT,
            "stream": True, "ignore_eos": True}  # fmt: skip

    def raw_stream():
        u = urllib.parse.urlparse(front)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
        headers = {"Content-Type": "application/json", **AUTH}
        conn.request("POST", u.path + "/completions", json.dumps(body), headers)
        r = conn.getresponse()
        events = []
        for line in r:
            if line.startswith(b"data: "):
                events.append(line[6:].decode().strip())
                if len(events) == 3:
                    started[0].set()
        results["raw"] = (r.status, events)

    def sdk_stream():
        stream = sdk(front).completions.create(
            model=NAME, prompt=body["prompt"], max_tokens=LIMIT, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        n = 0
        try:
            for _ in stream:
                n += 1
                if n == 3:
                    started[1].set()
        except Exception as e:  # noqa: BLE001 - what the SDK raises is the result
            results["sdk"] = (n, e)

    threads = [threading.Thread(target=f, daemon=True) for f in (raw_stream, sdk_stream)]
    for t in threads:
        t.start()
    assert all(s.wait(180) for s in started), "the streams did not start"
    os.killpg(srv.pid, signal.SIGKILL)  # tritonserver and its stage processes
    for t in threads:
        t.join(120)
    status, events = results["raw"]
    assert status == 200 and events[-1] == "[DONE]" and len(events) < LIMIT + 2, events[-3:]
    err = json.loads(events[-2])["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"], err
    assert "choices" in json.loads(events[-3])  # tokens, then the error, then [DONE]
    n, e = results["sdk"]
    assert n >= 3 and isinstance(e, openai.APIError), repr(e)
    assert not isinstance(e, openai.APIConnectionError), repr(e)  # the server's answer, parsed
    assert e.message and e.message == e.body["message"] and e.body["code"], (e.message, e.body)
    with pytest.raises(openai.InternalServerError) as down:
        sdk(front).completions.create(model=NAME, prompt="Hi", max_tokens=2)
    assert down.value.status_code == 503 and down.value.response.headers["retry-after"] == "1"
    assert down.value.code == "server_unavailable" and "unreachable" in down.value.body["message"]
    chat = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "stream": True}
    status, headers, body = raw(front, "POST", "/chat/completions", json.dumps(chat).encode())
    assert status == 503 and headers["Retry-After"] == "1" and body["error"]["code"]
