"""OpenAI-style errors: a status code and ``{"error": {message, type, param, code}}``, ``code``
always filled, for every failure the front answers (docs/serving.md, "Errors").

Errors are classified by type, never by the words of a message:

* the stages' errors arrive as the text of a Triton error whose tag
  (``backends/stages/errors.py``) gives the kind (invalid: 400, overloaded: 503 with
  ``Retry-After``, internal or no tag: 500), the ensemble input at fault (mapped to the
  request's field by :mod:`.protocol`) and a code; :func:`from_stage`;
* an error with no tag came from Triton itself, not from a stage (a stage process that died:
  "Stub process ... is not healthy" until the supervisor's reload): a 500 whose ``from_triton``
  lets the front retry it while no token was sent (:mod:`.app`);
* a broken connection to Triton is a gRPC status: UNAVAILABLE (Triton restarting or gone) and
  RESOURCE_EXHAUSTED are a 503 with ``Retry-After``, DEADLINE_EXCEEDED a 504, any other a 502;
  :func:`from_transport`.
"""

from __future__ import annotations

import grpc
from fastapi.responses import JSONResponse
from tritonclient.utils import InferenceServerException

from ..stages import errors as stage_errors

RETRY_AFTER_S = 1

_TYPE = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
}
_CODE = {
    400: "invalid_value",
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    499: "client_closed_request",
    500: "internal_error",
    502: "bad_gateway",
    503: "server_unavailable",
    504: "timeout",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "",
        code: str | None = None,
        from_triton: bool = False,
    ):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.from_triton = from_triton  # Triton's own failure: no stage answered
        self.kind = kind or _TYPE.get(status, "server_error")
        self.code = code or _CODE.get(status, "error")

    def body(self) -> dict:
        err = {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        return {"error": err}

    def response(self) -> JSONResponse:
        headers = {}
        if self.status in (429, 503):
            headers["Retry-After"] = str(RETRY_AFTER_S)
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


def invalid(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def overloaded(message: str) -> APIError:
    return APIError(503, message, kind="server_overloaded", code="overloaded")


def from_stage(text: str, params: dict[str, str] | None = None) -> APIError:
    """The client-facing error for the text of an ensemble error; ``params``: ensemble input
    -> the request's field (the tag's param is shown as that field, or not at all)."""
    tag = stage_errors.parse_tag(text)
    if tag.kind == stage_errors.OVERLOADED:
        return overloaded(tag.message)
    if tag.kind == stage_errors.INVALID:
        param = (params or {}).get(tag.param) if tag.param else None
        return APIError(400, tag.message, param, code=tag.code)
    return APIError(500, tag.message, from_triton=not tag.tagged)


_STATUS = {
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


def from_transport(exc: BaseException, url: str) -> APIError:
    """The client-facing error for a failed call to Triton at ``url``: a ``grpc.RpcError``
    (the aio stream's own) or tritonclient's ``InferenceServerException`` (its ``status()``
    names the gRPC code)."""
    if isinstance(exc, grpc.RpcError):
        code, detail = exc.code(), exc.details()
    elif isinstance(exc, InferenceServerException):
        name = str(exc.status() or "").rpartition(".")[2]
        code, detail = getattr(grpc.StatusCode, name, None), exc.message()
    else:
        raise TypeError(f"not a transport error: {type(exc).__name__}")
    status = _STATUS.get(code, 502)
    what = "unreachable, retry later" if status == 503 else "failed"
    name = code.name if code is not None else "unknown status"
    return APIError(status, f"the inference server ({url}) {what}: {name}: {detail}")


def internal(exc: BaseException) -> APIError:
    """The 500 of an exception nothing else classified (logged with its traceback by the
    caller)."""
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}"[:500])
