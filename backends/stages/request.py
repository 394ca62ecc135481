"""The internal request: ONE typed struct that travels preprocess -> prefill -> decode.

It crosses the ensemble as the BYTES tensor ``REQUEST`` (msgpack of :class:`StageRequest`), so
a stage never re-lists the request's fields. Its sampling part is the runtime's own
:class:`~backends.runtime.sampler.SamplingParams` (temperature, top_p, top_k, seed, max_tokens,
ignore_eos), validated again when decoded: adding a sampling field touches that dataclass and
the client-facing input, nothing in between.
"""

from __future__ import annotations

import secrets

import msgspec

from ..runtime.sampler import SamplingParams

REQUEST_TENSOR = "REQUEST"


class StageRequest(msgspec.Struct, frozen=True, kw_only=True):
    room: int  # random 63-bit KV bootstrap room, drawn by preprocess
    prompt_ids: list[int]
    sampling: SamplingParams  # includes max_tokens and ignore_eos
    stream: bool = False  # one response per decode step (else one at the end)
    bootstrap_addr: str = ""  # the prefill instance's KV bootstrap endpoint, set by prefill

    def with_bootstrap(self, addr: str) -> StageRequest:
        return msgspec.structs.replace(self, bootstrap_addr=addr)


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(StageRequest)


def encode(req: StageRequest) -> bytes:
    return _enc.encode(req)


def decode(data: bytes) -> StageRequest:
    """ValueError (naming the bad field) for anything that is not a valid request."""
    try:
        return _dec.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"invalid {REQUEST_TENSOR} tensor: {e}") from None


def new_room() -> int:
    """A random 63-bit bootstrap room (fits INT64, never 0)."""
    return secrets.randbits(63) or 1
