"""The OpenAI front's own logic (no server): overload answers, error params, seeds, message
names, and the chat / completions forms of ``logprobs`` in Triton's frontend format."""

from __future__ import annotations

import json

import numpy as np
import pytest
from fastapi.testclient import TestClient

from backends.openai import protocol as oai
from backends.openai.app import create_app
from backends.openai.errors import APIError, from_server
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


def test_server_errors_name_the_request_field():
    fields = ("model", "messages", "temperature", "logprobs", "prompt")
    e = from_server("invalid request: temperature must be >= 0, got -1.0", fields)
    assert (e.status, e.param) == (400, "temperature")
    e = from_server("invalid request: top_logprobs must be in [0, 20]", fields)
    assert e.param == "logprobs"
    e = from_server("invalid request: text_input is empty: give a prompt", fields)
    assert e.param == "prompt"
    assert from_server("overloaded, retry later: prefill0 holds 9", fields).status == 503
    assert from_server("stage died", fields).status == 500


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
