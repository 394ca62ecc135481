"""One request to the ensemble as a Triton gRPC stream (tritonclient's asyncio client).

The ensemble is decoupled, so even a non-streaming request goes over ``ModelStreamInfer``; its
last response is the one with a ``finish_reason``. :meth:`Session.cancel` (a client that went
away) cancels the gRPC call: Triton marks the request cancelled, postprocess forwards a Cancel
to decode, and the request's KV pages are freed on both stages. Every failure leaves as an
:class:`~.errors.APIError`: a stage's error by its tag, a broken call to Triton by its gRPC
status (Triton restarting or gone: 503).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aio
from tritonclient.utils import InferenceServerException

from .errors import APIError, from_stage, from_transport

_DTYPES = {
    np.float32: "FP32",
    np.int32: "INT32",
    np.int64: "INT64",
    np.bool_: "BOOL",
    np.object_: "BYTES",
}


@dataclass
class Chunk:
    """One ensemble response."""

    text: str
    token_ids: list[int]
    finish_reason: str
    num_input_tokens: int
    logprobs: list[dict] | None  # per token {id: {logprob, rank, decoded_token}}
    num_cached_tokens: int = 0  # of the prompt, served from the prefix cache

    @classmethod
    def of(cls, result) -> Chunk:
        lp = result.as_numpy("logprobs")
        lp = json.loads(lp.reshape(-1)[0].decode()) if lp is not None else None
        return cls(
            text=result.as_numpy("text_output").reshape(-1)[0].decode("utf-8"),
            token_ids=[int(x) for x in result.as_numpy("output_ids").reshape(-1)],
            finish_reason=result.as_numpy("finish_reason").reshape(-1)[0].decode(),
            num_input_tokens=int(result.as_numpy("num_input_tokens").reshape(-1)[0]),
            logprobs=lp,
            num_cached_tokens=_scalar(result, "num_cached_tokens"),
        )


def _scalar(result, name: str) -> int:
    """An optional integer output (0 when the server does not send it)."""
    out = result.as_numpy(name)
    return int(out.reshape(-1)[0]) if out is not None else 0


@dataclass
class Session:
    client: aio.InferenceServerClient
    model: str
    inputs: dict[str, np.ndarray]
    params: dict[str, str] = field(default_factory=dict)  # ensemble input -> request field
    url: str = ""  # Triton's gRPC address (for errors)
    _done: asyncio.Event = field(default_factory=asyncio.Event)
    _call: object = None

    async def _requests(self):
        tensors = []
        for name, arr in self.inputs.items():
            t = grpcclient.InferInput(name, list(arr.shape), _DTYPES[arr.dtype.type])
            t.set_data_from_numpy(arr)
            tensors.append(t)
        yield {"model_name": self.model, "inputs": tensors}
        await self._done.wait()  # keep the stream open until the last response

    async def chunks(self):
        """The ensemble's responses, up to the one with a finish reason; APIError on an error."""
        try:
            self._call = self.client.stream_infer(self._requests())
            async for result, error in self._call:
                if error is not None:
                    raise from_stage(error.message(), self.params)
                chunk = Chunk.of(result)
                yield chunk
                if chunk.finish_reason:
                    return
            raise APIError(502, "the inference server closed the stream before the last response")
        except (grpc.RpcError, InferenceServerException) as e:
            raise from_transport(e, self.url) from None
        finally:
            self._done.set()

    def cancel(self) -> None:
        self._done.set()
        if self._call is not None:
            self._call.cancel()
