"""The request tensors of Triton's own OpenAI frontend (``server/python/openai``), mapped onto
this ensemble's inputs.

Started with ``--backend vllm`` it sends rank-1 tensors that this ensemble declares:
``text_input``, ``stream``, ``exclude_input_in_output`` (echo is its negation),
``sampling_parameters`` (one JSON string: ``max_tokens``, ``temperature``, ``top_p``, ``top_k``,
``seed``, ``stop``, penalties, ``logprobs``, ``n``, ``ignore_eos``...), ``return_logprobs`` and
``return_num_input_tokens`` / ``return_num_output_tokens`` (the outputs ``num_input_tokens``,
``num_output_tokens`` and ``logprobs`` come with every response anyway). Its TensorRT-LLM names
``stop_words`` (= ``stop``), ``frequency_penalty`` and ``presence_penalty`` are inputs too.

A field given both as its own input and in ``sampling_parameters`` is refused (which one wins
would be a guess); so is a ``sampling_parameters`` key this server does not implement.
``logprobs`` there is the chat form (``true``/``false``, with ``top_logprobs``: N) or the
completions form (an integer N); a negative ``seed`` (valid in the OpenAI API) is taken modulo
2**63, since this server reads a negative seed input as "no seed".
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from .errors import InvalidRequest

# sampling_parameters keys taken as the input of the same name (or the name given)
_JSON_KEYS = {
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "seed": "seed",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "ignore_eos": "ignore_eos",
}
# keys whose only accepted value is the one this server implements anyway
_JSON_FIXED = {"n": 1, "best_of": 1, "skip_special_tokens": True, "detokenize": True}


def _one(name: str, v: Any) -> Any:
    arr = np.asarray(v)
    if arr.size != 1:
        raise InvalidRequest(
            f"input {name} must hold exactly one value, got shape {list(arr.shape)}", name
        )
    x = arr.reshape(-1)[0]
    return x.decode("utf-8", errors="replace") if isinstance(x, bytes) else x


def frontend_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    """``inputs`` with the frontend's names and its JSON parameters turned into this
    ensemble's inputs; InvalidRequest naming the field for anything it cannot honour."""
    out = {k: v for k, v in inputs.items() if v is not None}
    if "top_logprobs" in out:  # the input's name (an ensemble output is called logprobs)
        out["logprobs"] = out.pop("top_logprobs")
    if "stop_words" in out:
        if "stop" in out:
            raise InvalidRequest("give stop or stop_words, not both", "stop_words")
        out["stop"] = out.pop("stop_words")
    if "exclude_input_in_output" in out:
        if "echo" in out:
            raise InvalidRequest(
                "give echo or exclude_input_in_output, not both", "exclude_input_in_output"
            )
        out["echo"] = not bool(_one("exclude_input_in_output", out.pop("exclude_input_in_output")))
    for flag in ("return_num_input_tokens", "return_num_output_tokens", "return_logprobs"):
        out.pop(flag, None)  # those outputs come with every response
    raw = out.pop("sampling_parameters", None)
    if raw is None:
        return out
    try:
        sp = json.loads(str(_one("sampling_parameters", raw)))
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"input sampling_parameters is not JSON: {e}", SP) from None
    if not isinstance(sp, dict):
        raise InvalidRequest("input sampling_parameters must be a JSON object", SP)
    _logprobs(sp)
    if isinstance(sp.get("seed"), int) and sp["seed"] < 0:
        sp["seed"] %= SEED_MOD
    for key, value in sp.items():
        if key in _JSON_FIXED:
            if value not in (None, _JSON_FIXED[key]):
                raise InvalidRequest(
                    f"sampling_parameters.{key} = {value!r} is not supported"
                    f" (only {_JSON_FIXED[key]!r})",
                    SP,
                )
            continue
        name = "logprobs" if key == "logprobs" else _JSON_KEYS.get(key)
        if name is None:
            raise InvalidRequest(f"sampling_parameters.{key} is not supported by this server", SP)
        if value is None:
            continue
        if name in out:
            raise InvalidRequest(f"{key} given both as an input and in sampling_parameters", SP)
        out[name] = [value] if isinstance(value, str) else value
    return out


SEED_MOD = 2**63
SP = "sampling_parameters"


def _logprobs(sp: dict[str, Any]) -> None:
    """``sp``'s ``logprobs`` / ``top_logprobs`` turned into one ``logprobs``: N (or none)."""
    top = sp.pop("top_logprobs", None)
    lp = sp.get("logprobs")
    if isinstance(lp, bool):  # the chat form: logprobs true/false, top_logprobs N
        sp["logprobs"] = (top or 0) if lp else None
    elif top is not None:
        raise InvalidRequest("sampling_parameters.top_logprobs needs logprobs: true", SP)
