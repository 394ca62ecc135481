"""Stage features every client gets (gRPC here): stop strings and stop token ids, token counts,
finish reasons, logprobs, a missing max_tokens, max_tokens 1; and exactly the tensors Triton's
own OpenAI frontend (``--backend vllm``) sends, with what it reads back."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import triton_harness
from triton_harness import grpc_responses, http_generate, http_generate_stream

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
Q = "What is the capital of France?"


def test_triton_openai_frontend_tensors(server, reference):
    """What server/python/openai's vLLM request format sends for a streaming chat request,
    and what it reads: text_output per response, num_input_tokens / num_output_tokens
    (UINT32, output tokens per response, summed), logprobs JSON."""
    prompt = reference.tok.apply_chat_template(
        [{"role": "user", "content": Q}], add_generation_prompt=True, tokenize=False
    )
    want = reference.greedy(Q, True, 10)
    # a chat request as the frontend dumps it: every field with a default, logprobs in chat form
    sp = {"frequency_penalty": 0, "ignore_eos": False, "logprobs": True, "top_logprobs": 2,
          "n": 1, "presence_penalty": 0, "temperature": 0.0, "top_p": 1,
          "max_tokens": 10}  # fmt: skip
    fields = {
        "text_input": prompt, "stream": True, "exclude_input_in_output": True,
        "sampling_parameters": json.dumps(sp), "return_num_input_tokens": True,
        "return_num_output_tokens": True, "return_logprobs": True,
    }  # fmt: skip
    res, err = grpc_responses(server.grpc, fields)
    assert err is None
    assert "".join(r["text_output"] for r in res) == reference.text(want)
    assert {r["num_input_tokens"] for r in res} == {len(reference.prompt_ids(Q, True))}
    assert sum(r["num_output_tokens"] for r in res) == len(want)
    assert [r["finish_reason"] for r in res][-1] in ("stop", "length")
    lps = [e for r in res for e in json.loads(r["logprobs"])]
    assert len(lps) == len(want)
    for token, entry in zip(want, lps, strict=True):
        ranked = sorted(entry.items(), key=lambda kv: kv[1]["rank"])
        assert int(ranked[0][0]) == token  # greedy: the chosen token is the most likely
        assert len(entry) == 2 and ranked[0][1]["logprob"] >= ranked[1][1]["logprob"]


def test_frontend_trtllm_names_and_refusals(server, reference):
    full = reference.text(reference.greedy(Q, True, 12))
    fields = {"text_input": Q, "apply_chat_template": True, "max_tokens": 12,
              "stop_words": [" Paris", "xyz"]}  # fmt: skip
    res, err = grpc_responses(server.grpc, fields)
    assert err is None and res[-1]["finish_reason"] == "stop"
    assert "".join(r["text_output"] for r in res) == full[: full.index(" Paris")]
    bad = {"text_input": Q, "sampling_parameters": json.dumps({"n": 3})}
    _, err = grpc_responses(server.grpc, bad)
    assert err and "sampling_parameters.n" in err
    _, err = grpc_responses(server.grpc, {"text_input": Q, "sampling_parameters": "{not json"})
    assert err and "sampling_parameters is not JSON" in err


@pytest.mark.parametrize("stream", [False, True])
def test_stop_token_ids_and_echo(server, reference, stream):
    want = reference.greedy(Q, True, 12)
    stop_id = want[3]
    fields = {"text_input": Q, "apply_chat_template": True, "max_tokens": 12,
              "stop_token_ids": [stop_id], "stream": stream}  # fmt: skip
    res, err = grpc_responses(server.grpc, fields)
    assert err is None
    ids = [t for r in res for t in r["output_ids"]]
    assert ids == want[: want.index(stop_id) + 1] and res[-1]["finish_reason"] == "stop"
    out = http_generate(server, {"text_input": "The sky is", "max_tokens": 3, "echo": True})
    assert out["text_output"].startswith("The sky is") and out["finish_reason"] == "length"


def test_missing_max_tokens_takes_the_default(server):
    """default_max_tokens (256) capped by max_tokens_limit and the context left; /generate and
    /generate_stream (which once answered an empty body) both get it."""
    fields = {"text_input": "Say hi.", "apply_chat_template": True, "ignore_eos": True}
    out = http_generate(server, fields)
    assert out["status"] == 200, out
    assert out["finish_reason"] == "length"
    assert out["num_output_tokens"] == triton_harness.MAX_TOKENS_LIMIT
    events = http_generate_stream(server, {"text_input": "Say hi.", "stream": True})
    assert events and events[-1]["finish_reason"] in ("stop", "length"), events
    assert sum(e["num_output_tokens"] for e in events) >= 1


def test_max_tokens_1_is_exactly_one_response(server, reference):
    want = reference.greedy(Q, True, 1)
    for stream in (False, True):
        fields = {"text_input": Q, "apply_chat_template": True, "max_tokens": 1, "stream": stream}
        res, err = grpc_responses(server.grpc, fields)
        assert err is None and len(res) == 1, res
        assert res[0]["output_ids"] == want and res[0]["finish_reason"] == "length"
    out = http_generate(server, {"text_input": Q, "max_tokens": 1, "stream": True})
    assert out["status"] == 200, out
    # several responses are what stream asks for: Triton's generate refuses them, in the body of
    # an HTTP 200 (docs/serving.md)
    fields = {"text_input": Q, "apply_chat_template": True, "max_tokens": 3, "stream": True}
    assert "exactly 1 response" in http_generate(server, fields)["error"]
    events = http_generate_stream(server, {"text_input": Q, "max_tokens": 1, "stream": True})
    assert len(events) == 1 and events[0]["num_output_tokens"] == 1


def test_malformed_requests_name_the_field(server):
    for fields, name in (
        ({"text_input": Q, "max_tokens": 0}, "max_tokens"),
        ({"text_input": Q, "presence_penalty": 5.0}, "presence_penalty"),
        ({"text_input": Q, "top_logprobs": 99}, "logprobs"),
        ({"messages": '[{"role": "robot", "content": "x"}]'}, "role"),
        ({"text_input": ""}, "text_input"),
    ):
        out = http_generate(server, fields)
        assert out["status"] == 400, (fields, out)
        assert name in out["error"], (fields, out)


def test_a_burst_queues_instead_of_failing(server):
    """benchmarks.burst's short CI variant (its full run is 1,000 requests: docs/operations.md):
    every request of a concurrent burst succeeds, half of them streaming, and every page comes
    back."""
    cmd = [sys.executable, "-m", "benchmarks.burst", "--url", server.http,
           "--metrics", server.metrics_url, "--requests", "150", "--json"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=500)
    res = json.loads(out.stdout)
    assert out.returncode == 0 and res["ok"] == 150 and res["pages_in_use_after"] == 0, res
