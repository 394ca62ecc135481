"""Preprocess and postprocess of the sampling features (no Triton): every input by name, Triton's
OpenAI frontend formats, chats, the RESPONSE struct and its logprobs JSON; the OpenAI front's
request checks."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from transformers import AutoTokenizer

from backends.openai import protocol as oai
from backends.openai.errors import APIError
from backends.runtime.sampling_params import SamplingParams, TokenLogprob
from backends.stages import request as rq
from backends.stages.compat import frontend_inputs
from backends.stages.params import StageParams
from backends.stages.text import Postprocessor, Preprocessor, sampling_from

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "models", "smollm2-135m-instruct")


@pytest.fixture(scope="module")
def pre():
    return Preprocessor(StageParams(model_dir=MODEL, default_max_tokens=7))


def test_list_inputs_and_penalties_map_by_name():
    sp = sampling_from({
        "stop": np.array([b"\n\n", b"END"], dtype=object),
        "stop_token_ids": np.array([2, 5], np.int32), "logprobs": np.array([3], np.int32),
        "presence_penalty": [0.5], "frequency_penalty": np.array([-1.0], np.float32),
        "repetition_penalty": [1.2],
    })  # fmt: skip
    assert sp.stop == ("\n\n", "END") and sp.stop_token_ids == (2, 5) and sp.logprobs == 3
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -1.0, 1.2)
    assert sp.max_tokens == 16 and sampling_from({"logprobs": [-1]}).logprobs is None
    with pytest.raises(ValueError, match="presence_penalty"):
        sampling_from({"presence_penalty": [3.0]})
    with pytest.raises(ValueError, match="top_k must be an integer"):
        sampling_from({"top_k": [1.5]})


def test_triton_frontend_formats_become_inputs():
    raw = {"text_input": np.array([b"hi"], object), "exclude_input_in_output": np.array([False]),
           "sampling_parameters": np.array([json.dumps({"max_tokens": 5, "stop": "x", "n": 1,
                                                        "top_k": 3}).encode()], object),
           "return_num_input_tokens": np.array([True]), "stop_words": None}  # fmt: skip
    out = frontend_inputs(raw)
    assert out["echo"] is True and out["max_tokens"] == 5 and out["stop"] == ["x"]
    assert "return_num_input_tokens" not in out and "sampling_parameters" not in out
    assert sampling_from(out) == SamplingParams(max_tokens=5, stop=("x",), top_k=3)
    assert frontend_inputs({"stop_words": ["a"]})["stop"] == ["a"]
    for sp, msg in (
        ({"n": 2}, "sampling_parameters.n"),
        ({"min_tokens": 3}, "sampling_parameters.min_tokens is not supported"),
        ({"max_tokens": 4}, "given both"),
    ):
        with pytest.raises(ValueError, match=msg):
            frontend_inputs({"max_tokens": [4], "sampling_parameters": [json.dumps(sp)]})


def test_preprocess_default_max_tokens_chat_messages_and_echo(pre):
    req = pre.build({"text_input": "Hello", "echo": [True], "stream": [True]})
    assert req.sampling.max_tokens == 7 and req.echo and req.stream
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat = pre.build({"messages": json.dumps(msgs)})
    hf = AutoTokenizer.from_pretrained(MODEL)  # the independent reference
    want = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert chat.prompt_ids == hf(want, add_special_tokens=False).input_ids
    one = pre.build({"text_input": "Hi", "apply_chat_template": [True]})
    assert one.prompt_ids == pre.build({"messages": json.dumps(msgs[1:])}).prompt_ids
    for bad, msg in (
        ({"messages": "[]"}, "non-empty"),
        ({"messages": '[{"role": "tool", "content": "x"}]'}, r"messages\[0\].role"),
        ({"text_input": "x", "stop_token_ids": [10**6]}, "stop_token_ids"),
        ({"text_input": "x", "max_tokens": [5000]}, "max_tokens must be in"),
    ):
        with pytest.raises(ValueError, match=msg):
            pre.build(bad)


def test_response_round_trips_and_postprocess_builds_the_outputs(pre):
    lp = TokenLogprob(token=5, logprob=-0.25, top=((5, -0.25), (9, -2.0)), rank=1)
    res = rq.StageResponse(room=3, cancel_addr="tcp://x", text="Hi", token_ids=[5, 6],
                           logprobs=[lp, TokenLogprob(6, -3.0, ((9, -0.1),), rank=4)],
                           num_input_tokens=11, finish_reason="stop")  # fmt: skip
    back = rq.decode_response(rq.encode(res))
    assert back == res
    post = Postprocessor(StageParams(model_dir=MODEL), tokenizer=pre.tok)
    out = post.outputs(back)
    assert out["text_output"][0] == b"Hi" and out["output_ids"].tolist() == [5, 6]
    assert out["num_input_tokens"].dtype == np.uint32 and int(out["num_output_tokens"][0]) == 2
    assert out["finish_reason"][0] == b"stop"
    entries = json.loads(out["logprobs"][0])
    piece = pre.tok.decode([5], skip_special_tokens=False)
    assert entries[0]["5"] == {"logprob": -0.25, "rank": 1, "decoded_token": piece}
    assert entries[1]["6"]["rank"] == 4 and entries[1]["9"]["rank"] == 1
    plain = post.outputs(rq.StageResponse(room=1, cancel_addr="a", heartbeat=True))
    assert plain["logprobs"][0] == b"null"
    with pytest.raises(ValueError, match="RESPONSE"):
        rq.decode_response(b"junk")


def test_first_token_logprobs_travel_in_complete_extra():
    lp = TokenLogprob(7, -0.5, ((7, -0.5), (1, -1.5)), rank=1)
    extra = rq.logprob_extra(lp)
    assert rq.first_logprob(extra, 7, SamplingParams(logprobs=2)) == lp
    assert rq.first_logprob(extra, 7, SamplingParams()) is None
    assert rq.logprob_extra(None) == {}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"n": 3}, "n"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"tools": []}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        ({"messages": "hi"}, "messages"),
    ],
)
def test_openai_chat_refusals_name_the_field(body, param):
    full = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    with pytest.raises(APIError) as e:
        oai.chat_inputs(oai.parse(oai.ChatRequest, full))
    assert e.value.status == 400 and e.value.param == param


def test_openai_fields_map_onto_ensemble_inputs():
    req = oai.parse(oai.ChatRequest, {
        "model": "m",
        "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}]},
                     {"role": "user", "content": "b"}],
        "max_completion_tokens": 9, "max_tokens": 3, "stop": "\n", "logprobs": True,
        "top_logprobs": 2, "seed": 4, "top_k": 5, "user": "ignored",
    })  # fmt: skip
    inp = oai.chat_inputs(req)
    assert inp["max_tokens"].tolist() == [9] and inp["top_logprobs"].tolist() == [2]
    assert inp["stop"].tolist() == [b"\n"] and inp["top_k"].tolist() == [5]
    assert json.loads(inp["messages"][0]) == [
        {"role": "system", "content": "a"}, {"role": "user", "content": "b"}]  # fmt: skip
    comp = oai.completion_inputs(oai.parse(oai.CompletionRequest, {
        "model": "m", "prompt": [1, 2, 3], "logprobs": 0, "echo": True}))  # fmt: skip
    assert comp["input_ids"].tolist() == [1, 2, 3] and comp["top_logprobs"].tolist() == [0]
    assert comp["echo"].tolist() == [True] and "max_tokens" not in comp
    with pytest.raises(APIError, match="one prompt per request"):
        two = {"model": "m", "prompt": ["a", "b"]}
        oai.completion_inputs(oai.parse(oai.CompletionRequest, two))
