"""The internal request and response: ONE typed struct each way between the stages.

:class:`StageRequest` travels preprocess -> prefill -> decode as the BYTES tensor ``REQUEST``
(msgpack), so a stage never re-lists the request's fields. Its sampling part is the runtime's own
:class:`~backends.runtime.sampler.SamplingParams` (temperature, top_p, top_k, seed, max_tokens,
ignore_eos, penalties, stop strings and ids, logprobs), validated again when decoded: adding a
sampling field touches that dataclass and the client-facing input, nothing in between.

:class:`StageResponse` travels decode -> postprocess as the BYTES tensor ``RESPONSE``: the text
decode detokenized (stop strings already cut), the token ids, their logprobs, the finish reason
on the last one, and what postprocess needs to forward a client cancel.
"""

from __future__ import annotations

import secrets

import msgspec

from ..runtime.sampling_params import SamplingParams, TokenLogprob

REQUEST_TENSOR = "REQUEST"
RESPONSE_TENSOR = "RESPONSE"
# a request parameter: the prefill model keeps the call open until it is done with the room (an
# empty final response), so that a server dying mid-room breaks a forwarded call; without it (in
# the ensemble) its answer closes the call
HOLD_PARAM = "pd_hold_until_done"


class StageRequest(msgspec.Struct, frozen=True, kw_only=True):
    room: int  # random 63-bit KV bootstrap room, drawn by preprocess
    prompt_ids: list[int]
    sampling: SamplingParams  # includes max_tokens and ignore_eos
    stream: bool = False  # one response per decode step (else one at the end)
    echo: bool = False  # the first response's text starts with the prompt's
    bootstrap_addr: str = ""  # the prefill instance's KV bootstrap endpoint, set by prefill

    def with_bootstrap(self, addr: str) -> StageRequest:
        return msgspec.structs.replace(self, bootstrap_addr=addr)


class StageResponse(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    room: int  # the client's room (cancels name it)
    cancel_addr: str  # decode's cancel listener
    heartbeat: bool = False  # nothing for the client: lets postprocess see a cancel
    text: str = ""  # text these tokens add (held back while it may start a stop string)
    token_ids: list[int] = []  # new tokens (all of them when not streaming)
    logprobs: list[TokenLogprob] = []  # one per token id, when the request asked for them
    num_input_tokens: int = 0  # prompt tokens
    num_cached_tokens: int = 0  # of those, served from the prefix cache (computed by no one)
    finish_reason: str = ""  # on the last response: stop | length


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(StageRequest)
_dec_response = msgspec.msgpack.Decoder(StageResponse)


def encode(msg: StageRequest | StageResponse) -> bytes:
    return _enc.encode(msg)


def decode(data: bytes) -> StageRequest:
    """ValueError (naming the bad field) for anything that is not a valid request."""
    try:
        return _dec.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"invalid {REQUEST_TENSOR} tensor: {e}") from None


def decode_response(data: bytes) -> StageResponse:
    try:
        return _dec_response.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"invalid {RESPONSE_TENSOR} tensor: {e}") from None


def logprob_extra(lp: TokenLogprob | None) -> dict:
    """The first token's logprobs as entries of the Complete message's ``extra`` (flat lists:
    its values are scalars or lists of scalars)."""
    if lp is None:
        return {}
    return {
        "lp": lp.logprob,
        "lp_rank": lp.rank,
        "lp_top_ids": [t for t, _ in lp.top],
        "lp_top": [v for _, v in lp.top],
    }


def first_logprob(extra: dict, token: int, sampling: SamplingParams) -> TokenLogprob | None:
    """The first token's logprobs from prefill's ``extra`` (None when not asked for)."""
    if sampling.logprobs is None or "lp" not in extra:
        return None
    top = tuple(zip(extra.get("lp_top_ids", []), extra.get("lp_top", []), strict=True))
    return TokenLogprob(token, float(extra["lp"]), top, int(extra.get("lp_rank", 0)))


FEATURE_KEY = "draft_feature"  # Complete.extra: an EAGLE head's last-prompt-position feature
CACHED_KEY = "cached_tokens"  # Complete.extra: prompt tokens prefill served from its cache


def draft_feature(extra: dict):
    """An EAGLE head's input from prefill's Complete: the target's feature of the last prompt
    position (``extra["draft_feature"]``, float32 values) as a tensor, or None (no head)."""
    import torch

    values = extra.get(FEATURE_KEY)
    return None if values is None else torch.tensor(values, dtype=torch.float32)


def new_room() -> int:
    """A random 63-bit bootstrap room (fits INT64, never 0)."""
    return secrets.randbits(63) or 1
