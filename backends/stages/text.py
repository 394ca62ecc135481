"""Pre- and post-processing cores (no Triton): request validation, tokenization, text deltas.

:class:`Preprocessor` turns one request's client inputs into a :class:`StageRequest` (prompt
ids, sampling parameters, a random 63-bit bootstrap room) or raises ``ValueError`` naming the
input. Sampling inputs are found by name: every field of
:class:`~backends.runtime.sampler.SamplingParams` is read from the client input of the same
name when present (an optional integer given as a negative number means "none", e.g. seed -1).

:class:`Postprocessor` turns decode's token batches into text with :func:`text_delta`, which is
stateless: decode sends each new token batch with a few earlier tokens, so any postprocess
instance can serve any response. It also forwards client cancels to decode.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

import numpy as np

from ..runtime.sampler import SamplingParams
from ..runtime.sequence import check_context
from ..runtime.tokenizer import Tokenizer
from .cancel import CancelSender
from .params import StageParams
from .request import StageRequest, new_room

_SAMPLING_TYPES = typing.get_type_hints(SamplingParams)


def scalar(name: str, value: Any) -> Any:
    """The one value of a one-element input (any shape); ValueError otherwise."""
    arr = np.asarray(value)
    if arr.size != 1:
        raise ValueError(f"input {name} must hold exactly one value, got shape {list(arr.shape)}")
    v = arr.reshape(-1)[0]
    if isinstance(v, bytes):
        v = v.decode("utf-8", errors="replace")
    return v.item() if isinstance(v, np.generic) else v


def as_bool(v: Any) -> bool:
    return v.strip().lower() in ("1", "true", "yes") if isinstance(v, str) else bool(v)


def _cast(name: str, typ: Any, v: Any) -> Any:
    if typ is bool:
        return as_bool(v)
    if typ is float:
        return float(v)
    if typ is int:
        return int(v)
    if typing.get_origin(typ) in (typing.Union, types.UnionType):
        inner = [t for t in typing.get_args(typ) if t is not type(None)]
        v = _cast(name, inner[0], v)
        return None if isinstance(v, (int, float)) and v < 0 else v
    return v


def sampling_from(inputs: dict[str, Any]) -> SamplingParams:
    """SamplingParams from the client inputs that name its fields (others keep defaults)."""
    values = {
        f.name: _cast(f.name, _SAMPLING_TYPES[f.name], scalar(f.name, inputs[f.name]))
        for f in dataclasses.fields(SamplingParams)
        if inputs.get(f.name) is not None
    }
    return SamplingParams(**values)


class Preprocessor:
    def __init__(self, params: StageParams, tokenizer: Tokenizer | None = None):
        self.params = params
        self.tok = tokenizer or Tokenizer(params.model_path)
        self.vocab = len(self.tok.hf)

    def prompt_ids(self, inputs: dict[str, Any]) -> list[int]:
        ids = inputs.get("input_ids")
        if ids is not None and np.asarray(ids).size:
            ids = [int(t) for t in np.asarray(ids).reshape(-1)]
            bad = [t for t in ids if not 0 <= t < self.vocab]
            if bad:
                raise ValueError(f"input_ids {bad[:4]} outside the vocabulary [0, {self.vocab})")
            return ids
        text = inputs.get("text_input")
        text = None if text is None else str(scalar("text_input", text))
        if text is None or not text.strip():
            raise ValueError("text_input is empty: give a prompt (or input_ids)")
        chat = inputs.get("apply_chat_template")
        return self.tok.encode(text, chat=chat is not None and as_bool(scalar("chat", chat)))

    def build(self, inputs: dict[str, Any]) -> StageRequest:
        """``inputs``: client input name -> value (numpy array or Python value)."""
        p = self.params
        if inputs.get("max_tokens") is None:
            raise ValueError("max_tokens is required")
        max_tokens = int(scalar("max_tokens", inputs["max_tokens"]))
        if not 1 <= max_tokens <= p.max_tokens_limit:
            raise ValueError(f"max_tokens must be in [1, {p.max_tokens_limit}], got {max_tokens}")
        sampling = sampling_from(inputs)
        ids = self.prompt_ids(inputs)
        check_context(len(ids), sampling.max_tokens, p.max_context)
        stream = inputs.get("stream")
        stream = stream is not None and as_bool(scalar("stream", stream))
        return StageRequest(room=new_room(), prompt_ids=ids, sampling=sampling, stream=stream)


class Postprocessor:
    """Decode's token batches -> text; client cancels -> decode (see :mod:`.cancel`)."""

    def __init__(self, params: StageParams, tokenizer: Tokenizer | None = None):
        self.tok = tokenizer or Tokenizer(params.model_path)
        self.cancels = CancelSender(params.secret.encode() or None)

    def text(self, prefix_ids: list[int], new_ids: list[int]) -> str:
        return text_delta(self.tok, prefix_ids, new_ids)

    def cancel(self, cancel_addr: str, room: int) -> None:
        self.cancels.cancel(cancel_addr, room)

    def close(self) -> None:
        self.cancels.close()


def _visible(tok: Tokenizer, ids: list[int]) -> str:
    """Text of ``ids`` without a trailing incomplete UTF-8 sequence (shown as U+FFFD)."""
    return tok.decode(ids).rstrip("\ufffd")


def text_delta(tok: Tokenizer, prefix_ids: list[int], new_ids: list[int]) -> str:
    """The text ``new_ids`` add after ``prefix_ids`` (held-back partial characters included
    once they complete; a window prefix is enough)."""
    if not new_ids:
        return ""
    before = _visible(tok, prefix_ids) if prefix_ids else ""
    after = _visible(tok, prefix_ids + new_ids)
    if after.startswith(before):
        return after[len(before) :]
    common = 0  # detokenization is not always prefix-stable (space clean-up): best effort
    for a, b in zip(before, after, strict=False):
        if a != b:
            break
        common += 1
    return after[common:]
