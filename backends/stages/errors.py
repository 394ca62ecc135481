"""Errors the stage cores raise or report, and what a client sees for each.

* ``ValueError``: the request itself is invalid (Triton ``INVALID_ARG``, HTTP 400); it can never
  run as it is.
* :class:`Overloaded`: a bounded queue is full, or the request waited past its queue timeout
  before anything was computed for it; retry later (Triton ``UNAVAILABLE``: gRPC UNAVAILABLE,
  HTTP 503).
* anything else: an internal error for that request only (``INTERNAL``); the stage logs it and
  keeps serving.
"""

from __future__ import annotations


class Overloaded(RuntimeError):
    """Retry later: the stage is at its queue bound or the request waited too long."""

    def __init__(self, message: str):
        super().__init__(f"overloaded, retry later: {message}")


INVALID, OVERLOADED, INTERNAL = "invalid", "overloaded", "internal"


def kind_of(exc: BaseException) -> str:
    """The client-facing error kind of an exception."""
    if isinstance(exc, Overloaded):
        return OVERLOADED
    if isinstance(exc, (ValueError, TypeError)):
        return INVALID
    return INTERNAL
