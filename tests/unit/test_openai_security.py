"""The OpenAI front as an internet-facing service, without a server: API keys (401 in OpenAI's
shape, constant-time comparison, /health open, a non-loopback front needs a key), every field's
type and range checked before anything is cast (a 400 naming the field), bounded bodies (413
before parsing, a nesting limit), and OpenAI's error shape for every failure (Triton
unreachable: 503 with Retry-After; a stream that fails: an error event, then [DONE]; any
exception: a 500, never plain text)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from starlette.requests import Request

from backends.openai import app as app_module
from backends.openai import auth
from backends.openai import protocol as oai
from backends.openai.app import create_app
from backends.openai.errors import APIError
from backends.openai.limits import body_limit, depth, read_body
from backends.openai.session import Chunk
from backends.stages.keys import PLACEHOLDER

KEY, OTHER = "9f1c2e7a4b3d5c6e8f0a1b2c3d4e5f60", "0a9b8c7d6e5f4a3b2c1d0e9f8a7b6c5d"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMP = {"model": "m", "prompt": "hi"}
ROUTES = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
ROOT = Path(__file__).resolve().parents[2]


def client(**kw) -> TestClient:
    """The front on a Triton address nobody listens on (port 1)."""
    return TestClient(create_app("127.0.0.1:1", ("m",), **kw))


# ---- API keys ----------------------------------------------------------------------------------
def test_every_v1_route_needs_the_key_and_health_stays_open():
    with client(keys=(KEY.encode(), OTHER.encode())) as c:
        for headers in ({}, {"Authorization": f"Bearer {KEY[:-1]}x"}, {"Authorization": KEY},
                        {"Authorization": f"Basic {KEY}"}):  # fmt: skip
            for method, route in (("get", "/v1/models"), ("post", ROUTES["chat"]),
                                  ("post", ROUTES["completion"])):  # fmt: skip
                r = c.request(method, route, json=CHAT, headers=headers)
                assert r.status_code == 401, (headers, route)
                err = r.json()["error"]
                assert err["type"] == "invalid_request_error" and err["param"] is None
                assert err["code"] in ("invalid_api_key", "missing_api_key")
                assert r.headers["www-authenticate"] == "Bearer"
        for key in (KEY, OTHER):  # any of the keys, scheme in any case
            r = c.get("/v1/models", headers={"Authorization": f"bearer {key}"})
            assert r.status_code == 200 and r.json()["data"][0]["id"] == "m"
        health = c.get("/health")  # open (Triton is just not there)
        assert health.status_code == 503 and health.json()["requests_in_flight"] == 0


def test_the_key_is_checked_before_the_body_is_read():
    with client(keys=(KEY.encode(),), max_body_bytes=10) as c:
        r = c.post(ROUTES["chat"], content=b"{" * 1000)  # too large AND not JSON: 401 first
        assert r.status_code == 401


def test_keys_are_compared_in_constant_time_with_every_key(monkeypatch):
    calls = []

    def spy(a, b):
        calls.append((a, b))
        return a == b

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    keys = auth.APIKeys((KEY.encode(), OTHER.encode()))
    keys.check(f"Bearer {KEY}")  # the first matches: the second is compared all the same
    assert calls == [(KEY.encode(), KEY.encode()), (OTHER.encode(), KEY.encode())]
    with pytest.raises(APIError) as e:
        keys.check("Bearer nope")
    assert e.value.status == 401 and "nope" not in e.value.message


def test_keys_load_from_a_file_and_the_environment_and_weak_ones_are_refused(tmp_path):
    f = tmp_path / "keys"
    f.write_text(f"# the old one, until clients moved\n{KEY}\n\n{OTHER}  # new\n")
    assert auth.load_keys(str(f), {}) == (KEY.encode(), OTHER.encode())
    env = {"PD_API_KEY_FILE": str(f), "PD_API_KEY": "  7e6d5c4b3a29181706f5e4d3c2b1a090 "}
    assert auth.load_keys(None, env)[-1] == b"7e6d5c4b3a29181706f5e4d3c2b1a090"
    weak = [
        (PLACEHOLDER, ["line 1", "placeholder"]),
        ("sk-1234", ["too short"]),
        ("ab" * 16, ["different characters"]),
        ("# only a comment", ["no key"]),
    ]
    for bad, words in weak:
        f.write_text(bad + "\n")
        with pytest.raises(ValueError) as e:
            auth.load_keys(str(f), {})
        for w in [*words, "openssl rand -hex 32"]:
            assert w in str(e.value), (bad, str(e.value))
    assert auth.load_keys(None, {}) == ()


def test_a_front_off_loopback_refuses_to_start_without_a_key():
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        auth.check_binding(host, (), insecure=False)
    auth.check_binding("0.0.0.0", (KEY.encode(),), insecure=False)
    auth.check_binding("0.0.0.0", (), insecure=True)
    for host in ("0.0.0.0", "::", "10.1.2.3", "pd-decode"):
        with pytest.raises(ValueError, match="--api-key-file"):
            auth.check_binding(host, (), insecure=False)
    cmd = [sys.executable, "-m", "backends.openai", "--host", "0.0.0.0", "--check-config"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT, env={})
    assert out.returncode == 2 and "not a loopback address" in out.stderr, out.stderr
    assert "openssl rand -hex 32" in out.stderr


# ---- every field checked before anything is cast ----------------------------------------------
W32 = 2**32
BAD_FIELDS = [  # (kind, fields, the param the 400 names)
    ("chat", {"max_tokens": W32 + 5}, "max_tokens"),  # was sent as 5
    ("chat", {"max_tokens": 0}, "max_tokens"),
    ("chat", {"max_tokens": True}, "max_tokens"),
    ("chat", {"max_tokens": 5.5}, "max_tokens"),
    ("chat", {"max_tokens": "5"}, "max_tokens"),
    ("chat", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat", {"max_completion_tokens": 2**31}, "max_completion_tokens"),
    ("chat", {"top_k": W32 + 3}, "top_k"),  # was sent as 3
    ("chat", {"top_k": -2}, "top_k"),
    ("chat", {"seed": 2**63}, "seed"),
    ("chat", {"seed": -(2**63) - 1}, "seed"),
    ("chat", {"stop_token_ids": [2, W32 + 1]}, "stop_token_ids"),
    ("chat", {"stop_token_ids": [-1]}, "stop_token_ids"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("chat", {"logprobs": 1}, "logprobs"),
    ("chat", {"presence_penalty": 2.5}, "presence_penalty"),
    ("chat", {"frequency_penalty": -2.01}, "frequency_penalty"),
    ("chat", {"repetition_penalty": 0.0}, "repetition_penalty"),
    ("chat", {"repetition_penalty": 10.5}, "repetition_penalty"),
    ("chat", {"temperature": -0.1}, "temperature"),
    ("chat", {"temperature": 2.5}, "temperature"),
    ("chat", {"temperature": "0.5"}, "temperature"),
    ("chat", {"top_p": 0.0}, "top_p"),
    ("chat", {"top_p": 1.5}, "top_p"),
    ("chat", {"stream": "yes"}, "stream"),
    ("completion", {"prompt": [W32 + 1, 15]}, "prompt"),  # was sent as [1, 15]
    ("completion", {"prompt": [-1]}, "prompt"),
    ("completion", {"prompt": [1, "a"]}, "prompt"),
    ("completion", {"prompt": [True]}, "prompt"),
    ("completion", {"max_tokens": W32 + 5}, "max_tokens"),
    ("completion", {"logprobs": 21}, "logprobs"),
    ("completion", {"logprobs": -1}, "logprobs"),
    ("completion", {"echo": 1}, "echo"),
]


@pytest.mark.parametrize(("kind", "fields", "param"), BAD_FIELDS,
                         ids=[f"{k}-{json.dumps(f)[:40]}" for k, f, _ in BAD_FIELDS])  # fmt: skip
def test_an_out_of_range_field_is_a_400_naming_it(kind, fields, param):
    body = {**(CHAT if kind == "chat" else COMP), **fields}
    with client() as c:  # refused before Triton (not there) is called
        r = c.post(ROUTES[kind], json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_value"


def test_values_in_range_reach_the_ensemble_unchanged():
    edges = {"max_tokens": 2**31 - 1, "top_k": -1, "seed": 2**63 - 1,
             "stop_token_ids": [0, 2**31 - 1]}  # fmt: skip
    req = oai.parse(oai.ChatRequest, {**CHAT, **edges})
    inp = oai.chat_inputs(req)
    assert inp["max_tokens"].tolist() == [2**31 - 1] and "top_k" not in inp  # -1: off, as vLLM
    assert inp["seed"].tolist() == [2**63 - 1] and inp["stop_token_ids"].tolist() == [0, 2**31 - 1]
    comp = oai.completion_inputs(oai.parse(oai.CompletionRequest, {**COMP, "prompt": [1, 15]}))
    assert comp["input_ids"].tolist() == [1, 15]
    zero = oai.chat_inputs(oai.parse(oai.ChatRequest, {**CHAT, "top_k": 0}))
    assert zero["top_k"].tolist() == [0]


# ---- bounded bodies ----------------------------------------------------------------------------
def _request(headers: dict, chunks):
    """A Starlette request whose body comes from ``chunks``; returns (request, bytes read)."""
    read = [0]
    it = iter(chunks)

    async def receive():
        chunk = next(it, None)
        if chunk is None:
            return {"type": "http.request", "body": b"", "more_body": False}
        read[0] += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": True}

    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "method": "POST", "headers": raw}, receive), read


def _endless(size: int):
    while True:
        yield b"x" * size


def test_a_body_over_the_limit_is_a_413_before_it_is_read_or_parsed():
    http, read = _request({"Content-Length": str(10**12)}, _endless(1 << 16))
    with pytest.raises(APIError) as e:
        asyncio.run(read_body(http, 1 << 20))
    assert e.value.status == 413 and read[0] == 0  # refused on the header alone
    http, read = _request({}, _endless(1 << 16))  # chunked: counted while read
    with pytest.raises(APIError) as e:
        asyncio.run(read_body(http, 1 << 20))
    assert e.value.status == 413 and (1 << 20) < read[0] <= (1 << 20) + (1 << 16)
    assert e.value.body()["error"]["code"] == "request_too_large"
    http, _ = _request({}, [b'{"a": 1}'])
    assert asyncio.run(read_body(http, 1 << 20)) == b'{"a": 1}'


def test_the_front_answers_413_and_the_default_limit_fits_the_context():
    with client(max_body_bytes=1000) as c:
        big = {**CHAT, "messages": [{"role": "user", "content": "x" * 2000}]}
        r = c.post(ROUTES["chat"], json=big)
        assert r.status_code == 413 and "1000 bytes" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "invalid_request_error"
    assert body_limit() == 4 << 20 and body_limit(0, 2048) == 4 << 20
    assert body_limit(0, 131072) == 8 << 20 and body_limit(1000, 131072) == 1000


def test_deep_nesting_and_non_json_are_400s_never_a_recursion_error():
    assert depth(b'{"a": "[[[{{", "b": [[1], {"c": "\\"]]["}]}') == 3
    assert depth(b"[" * 100000) == 100000
    with client() as c:
        deep = '{"model": "m", "messages": [{"role": "user", "content": "hi", "x": ' + \
            "[" * 100000 + "]" * 100000 + "}]}"  # fmt: skip
        r = c.post(ROUTES["chat"], content=deep)
        assert r.status_code == 400 and "nests deeper than 32" in r.json()["error"]["message"]
        for body in (b"{", b'{"model": "m", "temperature": NaN}', b"\xff\xfe{", b"[1]"):
            r = c.post(ROUTES["chat"], content=body)
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value", body


# ---- OpenAI's error shape for every failure ----------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_triton_unreachable_is_a_503_with_retry_after(stream):
    with client() as c:
        for kind in ("chat", "completion"):
            body = {**(CHAT if kind == "chat" else COMP), "stream": stream}
            r = c.post(ROUTES[kind], json=body)
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            err = r.json()["error"]
            assert err["code"] == "server_unavailable" and "127.0.0.1:1" in err["message"]
            assert "UNAVAILABLE" in err["message"]


class _Session:
    """Stands in for a gRPC stream: yields ``chunks``, then raises ``then``."""

    chunks_: list = []
    then: BaseException | None = None

    def __init__(self, *_args):
        pass

    async def chunks(self):
        for c in self.chunks_:
            yield c
        if self.then is not None:
            raise self.then

    def cancel(self):
        pass


def _chunk(text, logprobs=None, finish=""):
    return Chunk(text, [7], finish, 3, logprobs)


def _sse(text: str) -> list:
    return [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]


@pytest.mark.parametrize(
    "then, status, code",
    [
        (APIError(503, "the inference server is unreachable"), 503, "server_unavailable"),
        (KeyError("7"), 500, "internal_error"),
    ],
)
def test_a_stream_that_fails_midway_sends_an_error_event_then_done(monkeypatch, then, status, code):
    monkeypatch.setattr(_Session, "chunks_", [_chunk("a"), _chunk("b")])
    monkeypatch.setattr(_Session, "then", then)
    monkeypatch.setattr(app_module, "Session", _Session)
    with client() as c:
        r = c.post(ROUTES["completion"], json={**COMP, "stream": True})
    assert r.status_code == 200
    events = _sse(r.text)
    assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["a", "b"]
    err = json.loads(events[2])["error"]
    assert err["code"] == code and set(err) == {"message", "type", "param", "code"}
    assert status == 500 or "unreachable" in err["message"]
    assert events[3:] == ["[DONE]"]


def test_any_unexpected_exception_is_a_500_in_openai_shape(monkeypatch, caplog):
    # a logprobs entry without the chosen token: building the answer raises KeyError
    lp = [{"8": {"logprob": -0.1, "rank": 1, "decoded_token": "b"}}]
    monkeypatch.setattr(_Session, "chunks_", [_chunk("a", lp, "stop")])
    monkeypatch.setattr(_Session, "then", None)
    monkeypatch.setattr(app_module, "Session", _Session)
    with client() as c:
        r = c.post(ROUTES["chat"], json={**CHAT, "logprobs": True})
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert (err["type"], err["code"]) == ("server_error", "internal_error")
        assert "KeyError" in err["message"]
        r = c.get("/v1/nothing-here")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert any(r.exc_info and r.exc_info[0] is KeyError for r in caplog.records)
