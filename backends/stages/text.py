"""Pre- and post-processing cores (no Triton): request validation and tokenization; responses.

:class:`Preprocessor` turns one request's client inputs into a :class:`StageRequest` (prompt
ids, sampling parameters, a random 63-bit bootstrap room) or raises
:class:`~.errors.InvalidRequest` naming the input (its ``param``). Sampling inputs are found by
name: every field of :class:`~backends.runtime.sampler.SamplingParams` is read from the client
input of the same name when present (an optional integer given as a negative number means
"none", e.g. seed -1; list fields such as ``stop`` take every element of the tensor). The
request formats of Triton's own OpenAI frontend are accepted too (see :mod:`.compat`).

The prompt is ``input_ids``, else ``messages`` (a JSON chat, rendered with the checkpoint's chat
template), else ``text_input`` (with ``apply_chat_template``: one user turn). A text prompt that
cannot fit the context is refused before it is tokenized, on a bound that needs no tokenization
(:attr:`~backends.runtime.tokenizer.Tokenizer.max_token_bytes`): a request of megabytes costs a
length, not a tokenizer pass; every other request is tokenized and checked exactly as before.

:class:`Postprocessor` turns decode's :class:`StageResponse` (text already detokenized, stop
strings cut, in decode) into the client outputs, and forwards client cancels to decode.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any

import numpy as np

from ..runtime.sampling_params import SamplingParams, check_context
from ..runtime.tokenizer import Tokenizer
from .cancel import CancelSender
from .compat import frontend_inputs
from .errors import CONTEXT_LENGTH_EXCEEDED, InvalidRequest
from .params import StageParams
from .request import StageRequest, StageResponse, new_room

_SAMPLING_TYPES = typing.get_type_hints(SamplingParams)


def scalar(name: str, value: Any) -> Any:
    """The one value of a one-element input (any shape); InvalidRequest otherwise."""
    arr = np.asarray(value)
    if arr.size != 1:
        raise InvalidRequest(
            f"input {name} must hold exactly one value, got shape {list(arr.shape)}", name
        )
    return _item(arr.reshape(-1)[0])


def _item(v: Any) -> Any:
    if isinstance(v, bytes):
        v = v.decode("utf-8", errors="replace")
    return v.item() if isinstance(v, np.generic) else v


def as_bool(v: Any) -> bool:
    return v.strip().lower() in ("1", "true", "yes") if isinstance(v, str) else bool(v)


def _cast(name: str, typ: Any, v: Any) -> Any:
    if typing.get_origin(typ) is tuple:  # tuple[X, ...]: every element of the input
        inner = typing.get_args(typ)[0]
        values = [v] if isinstance(v, (str, bytes)) else np.asarray(v, dtype=object).reshape(-1)
        return tuple(_cast(name, inner, _item(x)) for x in values)
    v = scalar(name, v) if isinstance(v, (np.ndarray, list)) else v
    if typ is bool:
        return as_bool(v)
    if typ is float:
        return float(v)
    if typ is int:
        if isinstance(v, float) and not v.is_integer():
            raise InvalidRequest(f"input {name} must be an integer, got {v!r}", name)
        return int(v)
    if typ is str:
        return str(v)
    if typing.get_origin(typ) in (typing.Union, types.UnionType):
        inner = [t for t in typing.get_args(typ) if t is not type(None)]
        v = _cast(name, inner[0], v)
        return None if isinstance(v, (int, float)) and v < 0 else v
    return v


def sampling_from(inputs: dict[str, Any], default_max_tokens: int = 16) -> SamplingParams:
    """SamplingParams from the client inputs that name its fields (others keep defaults); each
    field is checked on its own first, so that an error names the input at fault."""
    values = {}
    for f in dataclasses.fields(SamplingParams):
        if inputs.get(f.name) is None:
            continue
        try:
            values[f.name] = _cast(f.name, _SAMPLING_TYPES[f.name], inputs[f.name])
            SamplingParams(**{f.name: values[f.name]})  # this field's own range
        except (TypeError, ValueError) as e:
            msg = str(e) if f.name in str(e) else f"input {f.name}: {e}"
            raise InvalidRequest(msg, f.name) from None
    values.setdefault("max_tokens", default_max_tokens)
    try:
        return SamplingParams(**values)
    except ValueError as e:  # fields that do not go together
        raise InvalidRequest(str(e)) from None


class Preprocessor:
    def __init__(self, params: StageParams, tokenizer: Tokenizer | None = None):
        self.params = params
        self.tok = tokenizer or Tokenizer(params.model_path)
        self.vocab = self.tok.vocab_size

    def prompt_ids(self, inputs: dict[str, Any], max_tokens: int | None = None) -> list[int]:
        """The prompt's token ids. A prompt that cannot fit the context with ``max_tokens``
        (the request's, if it gives one) more is refused before it is tokenized where a bound
        shows it (module docstring)."""
        where = prompt_input(inputs)
        if where == "input_ids":
            arr = np.asarray(inputs["input_ids"]).reshape(-1)
            self._refuse_long(arr.size, max_tokens, where)
            ids = [int(t) for t in arr]
            bad = [t for t in ids if not 0 <= t < self.vocab]
            if bad:
                raise InvalidRequest(
                    f"input_ids {bad[:4]} outside the vocabulary [0, {self.vocab})", where
                )
            return ids
        if where == "messages":
            chat = parse_messages(str(scalar("messages", inputs["messages"])))
            return self._encode(self._render(chat, where), False, max_tokens, where)
        text = inputs.get("text_input")
        text = None if text is None else str(scalar("text_input", text))
        if text is None or not text.strip():
            raise InvalidRequest(
                "text_input is empty: give a prompt (or input_ids, or messages)", where
            )
        chat = inputs.get("apply_chat_template")
        if chat is not None and as_bool(scalar("apply_chat_template", chat)):
            text = self._render([{"role": "user", "content": text}], "apply_chat_template")
            return self._encode(text, False, max_tokens, where)
        return self._encode(text, True, max_tokens, where)

    def _render(self, chat: list[dict[str, str]], param: str) -> str:
        try:
            return self.tok.render_chat(chat)
        except ValueError as e:  # no chat template in this checkpoint
            raise InvalidRequest(str(e), param) from None

    def _encode(self, text: str, special: bool, max_tokens: int | None, param: str) -> list[int]:
        bound = self.tok.max_token_bytes
        if bound:  # at least ceil(bytes / bound) tokens, known without tokenizing
            self._refuse_long(-(-len(text.encode("utf-8")) // bound), max_tokens, param)
        return self.tok.encode_text(text, special)

    def _refuse_long(self, least: int, max_tokens: int | None, where: str) -> None:
        """Refuse a prompt of at least ``least`` tokens that cannot fit the context."""
        limit, m = self.params.max_context, max_tokens or 1
        if least + m > limit:
            raise InvalidRequest(
                f"prompt (at least {least} tokens) + max_tokens ({m}) exceeds the context limit"
                f" of {limit} tokens",
                self._context_param(least, max_tokens, where),
                CONTEXT_LENGTH_EXCEEDED,
            )

    def _context_param(self, prompt: int, max_tokens: int | None, where: str) -> str:
        """The input at fault when a prompt of ``prompt`` tokens + max_tokens passes the
        context: the prompt when it cannot fit alone, else a max_tokens the request gave."""
        return "max_tokens" if max_tokens and prompt < self.params.max_context else where

    def build(self, inputs: dict[str, Any]) -> StageRequest:
        """``inputs``: client input name -> value (numpy array or Python value)."""
        p = self.params
        inputs = frontend_inputs(inputs)
        given = None
        if inputs.get("max_tokens") is not None:
            given = _cast("max_tokens", int, inputs["max_tokens"])
            if not 1 <= given <= p.max_tokens_limit:
                raise InvalidRequest(
                    f"max_tokens must be in [1, {p.max_tokens_limit}], got {given}: the limit is"
                    " this server's repository parameter max_tokens_limit (docs/configuration.md),"
                    f" which an operator can raise up to max_context - 1 = {p.max_context - 1}",
                    "max_tokens",
                )
        ids = self.prompt_ids(inputs, given)
        room = min(p.default_max_tokens, p.max_tokens_limit, p.max_context - len(ids))
        sampling = sampling_from(inputs, max(1, room))
        bad = [t for t in sampling.stop_token_ids if t >= self.vocab]
        if bad:
            raise InvalidRequest(
                f"stop_token_ids {bad[:4]} outside the vocabulary [0, {self.vocab})",
                "stop_token_ids",
            )
        try:
            check_context(len(ids), sampling.max_tokens, p.max_context)
        except ValueError as e:
            param = self._context_param(len(ids), given, prompt_input(inputs))
            raise InvalidRequest(str(e), param, CONTEXT_LENGTH_EXCEEDED) from None
        flag = {k: inputs.get(k) is not None and as_bool(scalar(k, inputs[k])) for k in FLAGS}
        return StageRequest(
            room=new_room(),
            prompt_ids=ids,
            sampling=sampling,
            stream=flag["stream"],
            echo=flag["echo"],
        )


FLAGS = ("stream", "echo")


def prompt_input(inputs: dict[str, Any]) -> str:
    """The input a request's prompt comes from: ``input_ids`` (when not empty), else
    ``messages``, else ``text_input``."""
    ids = inputs.get("input_ids")
    if ids is not None and np.asarray(ids).size:
        return "input_ids"
    return "messages" if inputs.get("messages") is not None else "text_input"


def parse_messages(raw: str) -> list[dict[str, str]]:
    """A chat as JSON: ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``."""
    try:
        msgs = json.loads(raw)
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"input messages is not JSON: {e}", "messages") from None
    if not isinstance(msgs, list) or not msgs:
        raise InvalidRequest(
            "input messages must be a non-empty JSON list of {role, content}", "messages"
        )
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or set(m) - {"role", "content", "name"}:
            raise InvalidRequest(
                f"messages[{i}] must be an object with role and content", "messages"
            )
        if m.get("role") not in ("system", "user", "assistant"):
            raise InvalidRequest(
                f"messages[{i}].role must be system, user or assistant", "messages"
            )
        if not isinstance(m.get("content"), str):
            raise InvalidRequest(f"messages[{i}].content must be a string", "messages")
    return [{"role": m["role"], "content": m["content"]} for m in msgs]


class Postprocessor:
    """Decode's responses -> client outputs; client cancels -> decode (see :mod:`.cancel`)."""

    def __init__(self, params: StageParams, tokenizer: Tokenizer | None = None):
        self.tok = tokenizer or Tokenizer(params.model_path)
        self.cancels = CancelSender(params.secret.encode() or None)

    def outputs(self, res: StageResponse) -> dict[str, Any]:
        """The ensemble's outputs for one decode response (name -> numpy array)."""
        return {
            "text_output": np.array([res.text.encode("utf-8")], dtype=np.object_),
            "output_ids": np.asarray(res.token_ids, dtype=np.int32),
            "finish_reason": np.array([res.finish_reason.encode()], dtype=np.object_),
            "num_input_tokens": np.array([res.num_input_tokens], dtype=np.uint32),
            "num_cached_tokens": np.array([res.num_cached_tokens], dtype=np.uint32),
            "num_output_tokens": np.array([len(res.token_ids)], dtype=np.uint32),
            "logprobs": np.array([self.logprobs_json(res).encode()], dtype=np.object_),
        }

    def logprobs_json(self, res: StageResponse) -> str:
        """Per token ``{token id: {logprob, rank, decoded_token}}`` for the chosen token and its
        top alternatives (the format Triton's OpenAI frontend reads); ``null`` when not asked."""
        if not res.logprobs:
            return "null"
        out = []
        for lp in res.logprobs:
            entry = {
                str(t): {"logprob": v, "rank": i + 1, "decoded_token": self.piece(t)}
                for i, (t, v) in enumerate(lp.top)
            }
            entry[str(lp.token)] = {
                "logprob": lp.logprob,
                "rank": lp.rank,
                "decoded_token": self.piece(lp.token),
            }
            out.append(entry)
        return json.dumps(out)

    def piece(self, token: int) -> str:
        return self.tok.decode([token], skip_special_tokens=False)

    def cancel(self, cancel_addr: str, room: int) -> None:
        self.cancels.cancel(cancel_addr, room)

    def close(self) -> None:
        self.cancels.close()
