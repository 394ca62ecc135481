"""OpenAI request bodies -> ensemble inputs.

Every field of the OpenAI API is either mapped onto an ensemble input (see docs/serving.md,
"OpenAI API"), ignored because it has no effect on the output (``user``, ``metadata``,
``store``, ``service_tier``), or refused with a 400 that names it: this server never silently
drops a field that would change the answer. Extra fields vLLM's server accepts (``top_k``,
``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``) are mapped too. A message's
``name`` is refused (the chat templates here have no place for it). A negative ``seed`` (valid in
the API) is sent modulo 2**63: the ensemble reads a negative seed as "no seed"; ``top_k: -1``
is "off", as in vLLM.

Every field is checked for its type and range by the pydantic models below before anything is
cast (an integer over INT32 would otherwise wrap: ``max_tokens: 2**32 + 5`` sent as 5); a
value out of range is a 400 whose ``param`` names the field. What only the server knows (the
vocabulary, ``max_tokens_limit``, the context) preprocess checks: its typed error names the
ensemble input, and :func:`fields_of` maps that back onto the request's field.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..stages.compat import SEED_MOD
from .errors import APIError, invalid

IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}
MAX_STOP = 4
MAX_TOP_LOGPROBS = 20
INT32_MAX = 2**31 - 1  # the ensemble's integer inputs are INT32
INT64 = 2**63

Positive = Annotated[int, Field(ge=1, le=INT32_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]  # the vocabulary: checked by preprocess
TopN = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]

# Strict: a number is never read from a string, a boolean is never an integer, an integer field
# takes no fraction; no NaN or infinity. Every range is checked here, before anything is cast
# to the ensemble's INT32 / INT64 / FP32 inputs, so no value wraps or changes on the way.
_STRICT = ConfigDict(strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = ConfigDict(_STRICT, extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(_STRICT, extra="allow")
    model: str
    max_tokens: Positive | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: int | None = None
    seed: Annotated[int, Field(ge=-INT64, lt=INT64)] | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, float] | None = None
    # extras (vLLM's names); top_k -1 = off, as in vLLM
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None


class ChatRequest(_Common):
    messages: list[dict[str, Any]]
    max_completion_tokens: Positive | None = None
    logprobs: bool | None = None
    top_logprobs: TopN | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    logprobs: TopN | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_form(cls, v: Any) -> Any:
        """A string, a list of strings or a list of token ids (each an INT32 >= 0)."""
        if isinstance(v, str) or not isinstance(v, list):
            return v  # a list of strings, or the error the union gives
        if v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            bad = next((i for i, t in enumerate(v) if not 0 <= t <= INT32_MAX), None)
            if bad is not None:
                raise ValueError(f"prompt[{bad}] = {v[bad]} is not a token id in [0, {INT32_MAX}]")
        elif v and not all(isinstance(t, str) for t in v):
            raise ValueError("prompt must be a string, a list of strings or a list of token ids")
        return v


def parse(cls: type[_Common], body: Any) -> _Common:
    """The request, or an APIError (400) naming the first bad field."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    try:
        req = cls.model_validate(body)
    except ValidationError as e:
        raise _named(e) from None
    unknown = sorted(set(req.model_extra or {}) - IGNORED)
    if unknown:
        raise invalid(f"unsupported field(s): {', '.join(unknown)}", unknown[0])
    _refuse_common(req)
    return req


def _named(e: ValidationError) -> APIError:
    """The 400 of a validation error: its field (the union members pydantic names in a location
    left out), what is wrong and the value given."""
    err = e.errors(include_url=False)[0]
    loc = [x for x in err["loc"] if isinstance(x, int) or _is_field(x)]
    where = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc).lstrip(".")
    where = where or "body"
    param = str(err["loc"][0]) if err["loc"] else None
    if err["type"] == "value_error":  # this module's validators say it all
        return invalid(err["msg"].removeprefix("Value error, "), param)
    given = repr(err["input"])
    got = f" (got {given})" if err["type"] != "missing" and len(given) <= 60 else ""
    return invalid(f"{where}: {err['msg']}{got}", param)


def _is_field(name: str) -> bool:
    """Not one of the union members (``str``, ``list[int]``) pydantic puts in a location."""
    return name.isidentifier() and name not in ("str", "int", "float", "bool")


def _refuse_common(req: _Common) -> None:
    if req.n not in (None, 1):
        raise invalid("only n = 1 is supported", "n")
    if req.logit_bias:
        raise invalid("logit_bias is not supported", "logit_bias")
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options needs stream: true", "stream_options")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > MAX_STOP:
        raise invalid(f"stop takes at most {MAX_STOP} strings", "stop")


def _sampling_inputs(req: _Common, max_tokens: int | None) -> dict[str, np.ndarray]:
    inp: dict[str, np.ndarray] = {}
    scalars = {
        "temperature": (req.temperature, np.float32),
        "top_p": (req.top_p, np.float32),
        "top_k": (None if req.top_k == -1 else req.top_k, np.int32),  # -1: off (the default)
        "seed": (None if req.seed is None else req.seed % SEED_MOD, np.int64),
        "presence_penalty": (req.presence_penalty, np.float32),
        "frequency_penalty": (req.frequency_penalty, np.float32),
        "repetition_penalty": (req.repetition_penalty, np.float32),
        "ignore_eos": (req.ignore_eos, np.bool_),
        "max_tokens": (max_tokens, np.int32),
    }
    for name, (value, dtype) in scalars.items():
        if value is not None:
            inp[name] = np.array([value], dtype=dtype)
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if stops:
        inp["stop"] = np.array([s.encode() for s in stops], dtype=np.object_)
    if req.stop_token_ids:
        inp["stop_token_ids"] = np.array(req.stop_token_ids, dtype=np.int32)
    inp["stream"] = np.array([req.stream], dtype=np.bool_)
    return inp


def chat_inputs(req: ChatRequest) -> dict[str, np.ndarray]:
    inp = _sampling_inputs(req, req.max_completion_tokens or req.max_tokens)
    inp["messages"] = np.array([json.dumps(_messages(req.messages)).encode()], dtype=np.object_)
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
    if req.logprobs:
        inp["top_logprobs"] = np.array([req.top_logprobs or 0], dtype=np.int32)
    return inp


def _messages(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """OpenAI chat messages -> ``[{role, content}]`` with text content only."""
    if not messages:
        raise invalid("messages must not be empty", "messages")
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        role = "system" if role == "developer" else role
        if role not in ("system", "user", "assistant"):
            raise invalid(f"messages[{i}].role {role!r} is not supported", f"messages[{i}].role")
        for key in set(m) - {"role", "content"}:
            raise invalid(f"messages[{i}].{key} is not supported", f"messages[{i}].{key}")
        out.append({"role": role, "content": _text(m.get("content"), i)})
    return out


def _text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"messages[{i}].content must be a string or parts", f"messages[{i}].content")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            where = f"messages[{i}].content[{j}].type"
            raise invalid(f"{where} {kind!r} is not supported (text only)", where)
        parts.append(part["text"])
    return "".join(parts)


def completion_inputs(req: CompletionRequest) -> dict[str, np.ndarray]:
    if req.best_of not in (None, 1):
        raise invalid("only best_of = 1 is supported", "best_of")
    if req.suffix:
        raise invalid("suffix is not supported", "suffix")
    inp = _sampling_inputs(req, req.max_tokens)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise invalid("one prompt per request (a list of several is not supported)", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt must not be empty", "prompt")
        inp["text_input"] = np.array([prompt.encode()], dtype=np.object_)
    elif prompt:
        inp["input_ids"] = np.array(prompt, dtype=np.int32)
    else:
        raise invalid("prompt must not be empty", "prompt")
    if req.logprobs is not None:
        inp["top_logprobs"] = np.array([req.logprobs], dtype=np.int32)
    if req.echo:
        inp["echo"] = np.array([True], dtype=np.bool_)
    return inp


def check_model(name: str, served: tuple[str, ...]) -> None:
    if name not in served:
        msg = f"model {name!r} is not served here; models: {list(served)}"
        raise APIError(404, msg, "model", code="model_not_found")


# ensemble inputs named like the OpenAI field they come from
_SAME = (
    *("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids"),
    *("presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos", "echo"),
)


def fields_of(req: _Common) -> dict[str, str]:
    """Ensemble input -> the request's field it comes from: the ``param`` of a stage's error."""
    out = {name: name for name in _SAME}
    if isinstance(req, ChatRequest):
        out["messages"] = "messages"
        out["logprobs"] = "top_logprobs"  # the sampler's logprobs: N alternatives
        if req.max_completion_tokens is not None:
            out["max_tokens"] = "max_completion_tokens"
    else:
        out.update(text_input="prompt", input_ids="prompt", logprobs="logprobs")
    return out
