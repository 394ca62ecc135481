"""OpenAI-style errors: a status code and ``{"error": {message, type, param, code}}``."""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse

RETRY_AFTER_S = 1


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = ""):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or {
            400: "invalid_request_error",
            404: "not_found_error",
            503: "server_overloaded",
        }.get(status, "server_error")

    def body(self) -> dict:
        return {
            "error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}
        }

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if self.status in (429, 503) else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def invalid(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


# ensemble input names that differ from the OpenAI field they come from
_PARAM = {"text_input": "prompt", "input_ids": "prompt", "top_logprobs": "logprobs"}


def from_server(message: str, fields: tuple[str, ...] = ()) -> APIError:
    """The client-facing error for an error message of the ensemble; ``param`` is the first of
    ``fields`` (the request's own field names) that the message names."""
    if "overloaded, retry later" in message:
        return APIError(503, message)
    if "invalid request:" in message or "must be" in message or "exceeds the context" in message:
        words = (_PARAM.get(w, w) for w in re.findall(r"[A-Za-z_]+", message))
        return APIError(400, message, next((w for w in words if w in fields), None))
    return APIError(500, message)
