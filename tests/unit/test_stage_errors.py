"""The stages' typed client errors: only ``InvalidRequest`` is the client's fault (whatever a
message says), its tag carries the kind, the input at fault and a code through Triton; and
preprocess refuses a prompt that cannot fit the context before tokenizing it, on a bound that
never refuses a prompt that fits."""

from __future__ import annotations

import json
import math
import os
import random

import pytest

from backends.runtime.tokenizer import Tokenizer
from backends.stages import errors as se
from backends.stages.params import StageParams
from backends.stages.text import Preprocessor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "models", "smollm2-135m-instruct")


@pytest.fixture(scope="module")
def pre():
    return Preprocessor(StageParams(model_dir=MODEL, max_context=256, max_tokens_limit=64))


def test_only_the_typed_exception_is_the_clients_fault():
    assert se.kind_of(se.InvalidRequest("x", "top_k")) == se.INVALID
    assert se.kind_of(se.Overloaded("queue full")) == se.OVERLOADED
    for internal in (ValueError("max_tokens must be in [1, 8]"), TypeError("x"), KeyError(3)):
        assert se.kind_of(internal) == se.INTERNAL  # an internal error, however worded
    assert se.tag_of(se.InvalidRequest("x", "top_k", "c")) == {
        "kind": "invalid", "param": "top_k", "code": "c"}  # fmt: skip


def test_the_tag_carries_kind_param_and_code_and_comes_off():
    text = se.tagged("preprocess: too long", se.INVALID, "max_tokens", se.CONTEXT_LENGTH_EXCEEDED)
    tag = se.parse_tag("in ensemble 'ensemble', " + text)
    assert (tag.kind, tag.param, tag.code) == ("invalid", "max_tokens", "context_length_exceeded")
    assert tag.message == "in ensemble 'ensemble', preprocess: too long"
    assert se.parse_tag(se.tagged("busy", se.OVERLOADED)).kind == "overloaded"
    assert se.parse_tag("no tag at all: invalid request").kind == "internal"
    assert se.tagged("m", "bogus", param="a b]") == "[pd-error kind=internal] m"  # never breaks


@pytest.mark.parametrize(
    ("inputs", "param", "words"),
    [
        ({"text_input": "hi", "max_tokens": 65}, "max_tokens", ["64", "max_tokens_limit", "255"]),
        ({"text_input": "hi", "max_tokens": 0}, "max_tokens", ["[1, 64]"]),
        ({"text_input": "hi", "temperature": -1.0}, "temperature", ["temperature"]),
        ({"text_input": "hi", "top_k": 2.5}, "top_k", ["integer"]),
        ({"text_input": "hi", "max_tokens": [1, 2]}, "max_tokens", ["one value"]),
        ({"input_ids": [1, 10**6]}, "input_ids", ["vocabulary"]),
        ({"text_input": "hi", "stop_token_ids": [10**6]}, "stop_token_ids", ["vocabulary"]),
        ({"text_input": "  "}, "text_input", ["empty"]),
        ({"messages": "[{}]"}, "messages", ["role"]),
        ({"text_input": "hi", "sampling_parameters": '{"n": 2}'}, "sampling_parameters", ["n"]),
        ({"input_ids": list(range(250)), "max_tokens": 10}, "max_tokens", ["context limit"]),
    ],
)
def test_preprocess_refusals_are_typed_and_name_the_input(pre, inputs, param, words):
    with pytest.raises(se.InvalidRequest) as e:
        pre.build(inputs)
    assert e.value.param == param, str(e.value)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_a_prompt_past_the_context_is_refused_before_it_is_tokenized(pre, monkeypatch):
    bound = pre.tok.max_token_bytes
    assert bound and bound <= 256  # SmolLM2: byte-level BPE without a normalizer

    def never(*_a, **_k):
        raise AssertionError("tokenized a prompt the bound already refused")

    monkeypatch.setattr(pre.tok, "encode_text", never)
    chat = json.dumps([{"role": "user", "content": "y" * (300 * bound)}])
    for inputs in ({"text_input": "x" * (256 * bound)},
                   {"text_input": "word " * 10**6, "apply_chat_template": True},
                   {"messages": chat}):  # fmt: skip
        with pytest.raises(se.InvalidRequest) as e:
            pre.build(inputs)
        assert e.value.code == se.CONTEXT_LENGTH_EXCEEDED and "at least" in str(e.value)
    monkeypatch.undo()
    ids = pre.build({"text_input": "x" * 200, "max_tokens": 4}).prompt_ids  # fits: tokenized
    assert ids == Tokenizer(MODEL).encode("x" * 200)


def test_the_bound_never_exceeds_a_real_token_count():
    tok = Tokenizer(MODEL)
    bound = tok.max_token_bytes
    rng = random.Random(5)
    pieces = ["    ", "\n\n", "the", " quick", "東京", "🙂", "<|im_start|>", "<|endoftext|>",
              "================", "\t", "naïve", "0123456789", " " * 40, "-" * 64]  # fmt: skip
    for _ in range(200):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 60)))
        for special in (True, False):
            n = len(tok.encode_text(text, special))
            assert n >= math.ceil(len(text.encode()) / bound), text
    longest = max(tok.raw.get_vocab().values(), key=lambda i: len(tok.decode([i], False).encode()))
    assert len(tok.decode([longest], False).encode()) <= bound
