"""OpenAI request bodies -> ensemble inputs.

Every field of the OpenAI API is either mapped onto an ensemble input (see docs/serving.md,
"OpenAI API"), ignored because it has no effect on the output (``user``, ``metadata``,
``store``, ``service_tier``), or refused with a 400 that names it: this server never silently
drops a field that would change the answer. Extra fields vLLM's server accepts (``top_k``,
``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``) are mapped too. A message's
``name`` is refused (the chat templates here have no place for it). A negative ``seed`` (valid in
the API) is sent modulo 2**63: the ensemble reads a negative seed as "no seed".
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from ..stages.compat import SEED_MOD
from .errors import APIError, invalid

IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}
MAX_STOP = 4
MAX_TOP_LOGPROBS = 20


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # extras (vLLM's names)
    top_k: int | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None


class ChatRequest(_Common):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


def parse(cls: type[_Common], body: Any) -> _Common:
    """The request, or an APIError (400) naming the first bad field."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    try:
        req = cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise invalid(f"{where}: {err['msg']}", where) from None
    unknown = sorted(set(req.model_extra or {}) - IGNORED)
    if unknown:
        raise invalid(f"unsupported field(s): {', '.join(unknown)}", unknown[0])
    _refuse_common(req)
    return req


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
        "top_k": (req.top_k, np.int32),
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
        n = req.top_logprobs or 0
        if not 0 <= n <= MAX_TOP_LOGPROBS:
            raise invalid(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
        inp["top_logprobs"] = np.array([n], dtype=np.int32)
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
        if not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
            raise invalid(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "logprobs")
        inp["top_logprobs"] = np.array([req.logprobs], dtype=np.int32)
    if req.echo:
        inp["echo"] = np.array([True], dtype=np.bool_)
    return inp


def check_model(name: str, served: tuple[str, ...]) -> None:
    if name not in served:
        raise APIError(404, f"model {name!r} is not served here; models: {list(served)}", "model")
