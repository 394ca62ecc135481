"""The OpenAI-compatible front (serve.sh starts it) with the official ``openai`` SDK against the
session's real server: greedy chat and completions equal transformers token for token,
streaming or not; exact usage; stop strings and max_tokens finish reasons; penalties; logprobs
equal the runtime's own log-softmax; a client disconnect frees the pages; bad requests get a
400 naming the field and the server keeps serving."""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse

import openai
import pytest
import torch
from triton_harness import MODEL, metrics, wait_pages_free

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
NAME = "smollm2-135m-instruct"
Q = "What is the capital of France?"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.openai, api_key="unused", max_retries=0, timeout=120)


def chat_ids(reference, messages: list[dict]) -> list[int]:
    s = reference.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return reference.tok(s, add_special_tokens=False).input_ids


def greedy_from(reference, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = reference.model.generate(
            torch.tensor([ids]), max_new_tokens=n, do_sample=False,
            eos_token_id=reference.tok.eos_token_id, pad_token_id=reference.tok.eos_token_id,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


def test_models_and_health(client, server):
    assert NAME in [m.id for m in client.models.list().data]
    url = urllib.parse.urlparse(server.openai)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200


@pytest.mark.parametrize("stream", [False, True])
def test_chat_multi_turn_equals_transformers_with_exact_usage(client, reference, stream):
    messages = [
        {"role": "system", "content": "You are a terse geography tutor."},
        {"role": "user", "content": "Name a large river."},
        {"role": "assistant", "content": "The Nile."},
        {"role": "user", "content": Q},
    ]
    prompt = chat_ids(reference, messages)
    want = greedy_from(reference, prompt, 12)
    kw = {"model": NAME, "messages": messages, "max_tokens": 12, "temperature": 0}
    if stream:
        chunks = list(client.chat.completions.create(
            **kw, stream=True, stream_options={"include_usage": True}))  # fmt: skip
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        assert chunks[0].choices[0].delta.role == "assistant"
        usage = chunks[-1].usage
        assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    else:
        r = client.chat.completions.create(**kw)
        text, finish, usage = r.choices[0].message.content, r.choices[0].finish_reason, r.usage
        assert r.choices[0].message.role == "assistant"
    assert text == reference.text(want)
    assert finish == ("length" if len(want) == 12 else "stop")
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), len(want))
    assert usage.total_tokens == len(prompt) + len(want)


def test_a_repeated_prefix_is_reported_as_cached_tokens(client, reference):
    """The prefix cache (on by default): a repeated prompt's prefix is served from the cache,
    usage says how many tokens (page-aligned, at most the prompt), and every answer is the same
    as transformers'. This server runs two prefill instances, each with its own cache, and
    Triton may hand a repeat to either: of three repeats, those on the first one's instance hit."""
    system = "You are a patient tutor. " * 12  # a shared system prompt, several pages
    messages = [{"role": "system", "content": system}, {"role": "user", "content": Q}]
    prompt = chat_ids(reference, messages)
    want = reference.text(greedy_from(reference, prompt, 8))
    kw = {"model": NAME, "messages": messages, "max_tokens": 8, "temperature": 0}
    first = client.chat.completions.create(**kw)
    assert first.choices[0].message.content == want
    cached = []
    for _ in range(3):
        again = client.chat.completions.create(**kw)
        assert again.choices[0].message.content == want
        cached.append(again.usage.prompt_tokens_details.cached_tokens)
    assert all(c % 16 == 0 and c <= len(prompt) for c in cached), cached
    assert max(cached) >= 16 * (len(prompt) // 32), cached


@pytest.mark.parametrize("stream", [False, True])
def test_completion_equals_transformers(client, reference, stream):
    text = "The three primary colors are"
    want = reference.greedy(text, False, 10)
    r = client.completions.create(model=NAME, prompt=text, max_tokens=10, stream=stream,
                                  **({"stream_options": {"include_usage": True}} if stream else {}))
    if stream:
        chunks = list(r)
        out = "".join(c.choices[0].text for c in chunks if c.choices)
        usage = chunks[-1].usage
    else:
        out, usage = r.choices[0].text, r.usage
        assert r.choices[0].finish_reason == "length"
    assert out == reference.text(want)
    assert usage.prompt_tokens == len(reference.prompt_ids(text, False))
    assert usage.completion_tokens == 10


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_the_text(client, reference, stream):
    full = reference.text(reference.greedy(Q, True, 12))  # "The capital of France is Paris."
    stop = " is"
    assert stop in full
    kw = {"model": NAME, "messages": [{"role": "user", "content": Q}], "max_tokens": 12}
    if stream:
        chunks = list(client.chat.completions.create(**kw, stop=[stop], stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        r = client.chat.completions.create(**kw, stop=stop)
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert text == full[: full.index(stop)] and finish == "stop"


def test_penalties_change_the_output_and_are_seeded(client):
    kw = {"model": NAME, "prompt": "one one one one one one", "max_tokens": 16}
    plain = client.completions.create(**kw).choices[0].text
    pen = client.completions.create(**kw, frequency_penalty=2.0, presence_penalty=1.5)
    assert pen.choices[0].text != plain
    rep = client.completions.create(**kw, extra_body={"repetition_penalty": 1.8})
    assert rep.choices[0].text != plain
    sampled = [
        client.completions.create(**kw, temperature=0.9, seed=7, frequency_penalty=1.0)
        .choices[0].text for _ in range(2)
    ]  # fmt: skip
    assert sampled[0] == sampled[1]


def test_logprobs_equal_the_runtimes_log_softmax(client, reference):
    from backends.runtime.engine import LLMEngine
    from backends.runtime.loader import load_runner
    from backends.runtime.sampling_params import SamplingParams

    r = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": Q}], max_tokens=6,
        logprobs=True, top_logprobs=3,
    )  # fmt: skip
    got = r.choices[0].logprobs.content
    runner = load_runner(MODEL)
    engine = LLMEngine(runner, runner.make_pool(64, 16))
    seq = engine.generate([(reference.prompt_ids(Q, True), SamplingParams(max_tokens=6))])[0]
    ids = seq.output_ids
    prompt = reference.prompt_ids(Q, True)
    with torch.no_grad():  # the runtime's logits, one forward over prompt + output
        pool = runner.make_pool(64, 16)
        logits = runner.forward(pool, [_input(prompt + ids, pool)])[0][len(prompt) - 1 :]
    lsm = torch.log_softmax(logits.float(), -1)
    assert len(got) == len(ids)
    for i, (entry, token) in enumerate(zip(got, ids, strict=True)):
        assert entry.token == reference.tok.decode([token], skip_special_tokens=False)
        assert abs(entry.logprob - float(lsm[i, token])) < 1e-4
        best = torch.topk(lsm[i], 3)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            best.values.tolist(), abs=1e-4)  # fmt: skip


def _input(ids, pool):
    from backends.runtime.paged import SeqInput

    return SeqInput(ids, 0, pool.alloc(pool.pages_needed(len(ids))))


def test_disconnect_mid_stream_frees_the_pages(server):
    before = metrics(server).get(("pd_requests_cancelled_total", "decode"), 0)
    url = urllib.parse.urlparse(server.openai)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    body = {"model": NAME, "prompt": "Count from one to a thousand:", "max_tokens": 200,
            "stream": True, "ignore_eos": True}  # fmt: skip
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    seen = 0
    while seen < 3:  # a few tokens arrived: decode is running the request
        line = resp.fp.readline()
        seen += line.startswith(b"data: {")
    resp.close()  # the client goes away mid-stream (the response holds the socket too)
    conn.close()
    m = wait_pages_free(server, timeout=30)
    assert m[("pd_kv_pages_in_use", "decode")] == 0 and m[("pd_kv_pages_in_use", "prefill")] == 0
    end = time.time() + 10
    while metrics(server).get(("pd_requests_cancelled_total", "decode"), 0) <= before:
        assert time.time() < end, "decode never saw the cancel"
        time.sleep(0.2)


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"n": 2}, "n"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"temperature": -1}, None),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "messages[0].content[0].type"),
        ({"top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_bad_requests_get_a_400_naming_the_field(client, kw, param):
    body = {"model": NAME, "messages": [{"role": "user", "content": Q}], "max_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**body)
    err = e.value.body
    assert err["type"] == "invalid_request_error"
    if param:
        assert err["param"] == param and param.split("[")[0].split(".")[0] in err["message"]
    else:
        assert "temperature" in err["message"]
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": Q}],
                                       max_tokens=2)  # fmt: skip
    assert r.choices[0].message.content  # still serving


def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
