"""The OpenAI front's own logic (no server): overload answers, stage errors classified by their
tag (never by their words) and named by the request's field, seeds, message names, and the
chat / completions forms of ``logprobs`` in Triton's frontend format; a request Triton itself
failed before any token is tried again within the retry window, no other."""

from __future__ import annotations

import json

import numpy as np
import pytest
from fastapi.testclient import TestClient

from backends.openai import app as app_module
from backends.openai import protocol as oai
from backends.openai.app import create_app
from backends.openai.errors import APIError, from_stage
from backends.openai.session import Chunk
from backends.stages import errors as se
from backends.stages.compat import frontend_inputs
from backends.stages.text import sampling_from

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_overload_is_503_with_retry_after_and_an_openai_body():
    # no request may be in flight: the first one is refused before the front calls the server
    with TestClient(create_app("127.0.0.1:1", ("m",), max_inflight=0)) as client:
        for route, body in (("/v1/chat/completions", CHAT),
                            ("/v1/completions", {"model": "m", "prompt": "hi"})):  # fmt: skip
            r = client.post(route, json=body)
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            err = r.json()["error"]
            assert "overloaded, retry later" in err["message"]
            assert err["type"] == "server_overloaded"
        r = client.post("/v1/chat/completions", json={**CHAT, "model": "other"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_stage_errors_are_classified_by_their_tag_and_name_the_request_field():
    chat = oai.fields_of(oai.parse(oai.ChatRequest, {**CHAT, "max_completion_tokens": 5}))
    comp = oai.fields_of(oai.parse(oai.CompletionRequest, {"model": "m", "prompt": "hi"}))
    ensemble = "in ensemble 'ensemble', "  # what Triton's ensemble puts in front

    def stage(msg, kind, **tag):
        return ensemble + se.tagged(msg, kind, **tag)

    e = from_stage(stage("preprocess: temperature must be >= 0", "invalid", param="temperature"))
    assert (e.status, e.param, e.code) == (400, None, "invalid_value")  # no request: no field
    e = from_stage(stage("x", "invalid", param="temperature"), chat)
    assert (e.status, e.param, e.kind) == (400, "temperature", "invalid_request_error")
    assert e.message == ensemble + "x"  # the tag is for machines: not shown
    assert from_stage(stage("x", "invalid", param="logprobs"), chat).param == "top_logprobs"
    assert from_stage(stage("x", "invalid", param="logprobs"), comp).param == "logprobs"
    assert from_stage(stage("x", "invalid", param="input_ids"), comp).param == "prompt"
    assert from_stage(stage("x", "invalid", param="max_tokens"), chat).param == (
        "max_completion_tokens")  # fmt: skip
    long = stage("too long", "invalid", param="max_tokens", code=se.CONTEXT_LENGTH_EXCEEDED)
    assert from_stage(long, comp).code == "context_length_exceeded"
    busy = from_stage(stage("overloaded, retry later: prefill0 holds 9", "overloaded"), chat)
    assert (busy.status, busy.code, busy.kind) == (503, "overloaded", "server_overloaded")
    assert busy.response().headers["retry-after"] == "1"
    # words never decide: an internal error worded like a client's fault stays a 500, and so
    # does an error without a tag (Triton's own) or one whose first tag is internal (a router's
    # error that quotes a prefill server's refusal)
    worded = "invalid request: max_tokens must be in [1, 8]; exceeds the context"
    quoted = stage("router: " + se.tagged(worded, "invalid", param="max_tokens"), "internal")
    for text in (stage(worded, "internal"), worded, quoted):
        e = from_stage(text, chat)
        assert (e.status, e.param, e.code) == (500, None, "internal_error"), text
        assert "[pd-error" not in e.message


DEAD_STUB = "in ensemble 'ensemble', Stub process 'prefill_0_0' is not healthy."


class _Failing:
    """A stand-in for a gRPC stream whose first ``fails`` tries (counted over all instances)
    fail before any chunk with ``error``, and the later ones answer "ok"."""

    tries, fails, error = 0, 0, ""

    def __init__(self, *_args):
        type(self).tries += 1
        self.n = type(self).tries

    async def chunks(self):
        if self.n <= self.fails:
            raise from_stage(self.error)
        yield Chunk("ok", [7], "stop", 3, None)

    def cancel(self):
        pass


@pytest.mark.parametrize(
    "error, fails, window, tries, status",
    [
        (DEAD_STUB, 2, 30.0, 3, 200),  # Triton's own failure: tried again, then served
        (DEAD_STUB, 99, 0.25, 2, 500),  # ... within the window only (0.1 s pause, then 0.2)
        (DEAD_STUB, 1, 0.0, 1, 500),  # window 0: never tried again
        (se.tagged("decode failed for this request: x", "internal"), 1, 30.0, 1, 500),
        (se.tagged("overloaded, retry later: full", "overloaded"), 1, 30.0, 1, 503),
    ],
)
def test_only_what_triton_failed_before_any_token_is_tried_again(
    monkeypatch, error, fails, window, tries, status
):
    monkeypatch.setattr(_Failing, "tries", 0)
    monkeypatch.setattr(_Failing, "fails", fails)
    monkeypatch.setattr(_Failing, "error", error)
    monkeypatch.setattr(app_module, "Session", _Failing)
    with TestClient(create_app("127.0.0.1:1", ("m",), retry_window_s=window)) as client:
        for stream in (False, True):
            _Failing.tries = 0
            r = client.post("/v1/completions", json={"model": "m", "prompt": "hi",
                                                     "stream": stream})  # fmt: skip
            assert (r.status_code, _Failing.tries) == (status, tries), r.text
            if status == 200:
                assert "ok" in r.text
            else:
                assert r.json()["error"]["message"] == from_stage(error).message
        health = client.get("/health").json()
    assert health["requests_in_flight"] == 0 and health["requests_retried"] == 2 * (tries - 1)


def test_negative_seeds_are_kept_distinct_and_names_refused():
    inp = oai.chat_inputs(oai.parse(oai.ChatRequest, {**CHAT, "seed": -5}))
    assert inp["seed"].tolist() == [2**63 - 5]  # a negative input would mean "no seed"
    assert sampling_from(inp).seed == 2**63 - 5
    named = {**CHAT, "messages": [{"role": "user", "content": "hi", "name": "bob"}]}
    with pytest.raises(APIError) as e:
        oai.chat_inputs(oai.parse(oai.ChatRequest, named))
    assert e.value.param == "messages[0].name"


def _sp(**sp) -> dict:
    return frontend_inputs({"sampling_parameters": np.array([json.dumps(sp).encode()], object)})


def test_frontend_logprobs_chat_and_completions_forms():
    """What Triton's frontend (--backend vllm) puts in sampling_parameters: a chat request carries
    its defaults (logprobs false, n 1, penalties 0, top_p 1, ignore_eos false)."""
    chat_defaults = {"frequency_penalty": 0, "ignore_eos": False, "logprobs": False, "n": 1,
                     "presence_penalty": 0, "temperature": 0.7, "top_p": 1,
                     "max_tokens": 8}  # fmt: skip
    assert sampling_from(_sp(**chat_defaults)).logprobs is None  # false = off, never 0
    assert sampling_from(_sp(**{**chat_defaults, "logprobs": True})).logprobs == 0
    on = _sp(**{**chat_defaults, "logprobs": True, "top_logprobs": 3})
    assert sampling_from(on).logprobs == 3
    assert sampling_from(_sp(logprobs=2, best_of=1)).logprobs == 2  # completions: an integer
    assert sampling_from(_sp(seed=-1)).seed == 2**63 - 1
    with pytest.raises(ValueError, match="top_logprobs needs logprobs"):
        _sp(top_logprobs=2)
