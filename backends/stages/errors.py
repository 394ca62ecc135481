"""Errors the stage cores raise or report, what a client sees for each, and how a client tells
them apart by type.

* :class:`InvalidRequest` (a ``ValueError``): the client's request is invalid and can never run
  as it is (Triton ``INVALID_ARG``, HTTP 400); ``param`` names the client input at fault and
  ``code`` says what is wrong where a client may act on it (``context_length_exceeded``).
* :class:`Overloaded`: a bounded queue is full, or the request waited past its queue timeout
  before anything was computed for it; retry later (Triton ``UNAVAILABLE``: gRPC UNAVAILABLE,
  HTTP 503).
* :class:`Incompatible`: a peer of another deployment (secret, model, draft, KV layout or
  protocol differ) refused; it will refuse every request the same way. An internal error whose
  tag carries the code ``incompatible_deployment.<what differs>`` (:func:`incompatible_reason`),
  so a router stops routing to that server by the code, not by the words.
* anything else, a plain ``ValueError`` included: an internal error for that request only
  (``INTERNAL``); the stage logs it and keeps serving. Only the typed exception makes an error
  the client's fault, never the words of a message.

Triton's streaming gRPC API (``ModelStreamInfer``, which every decoupled ensemble call uses)
carries an error's message but not its code, so every stage error message starts with a
machine-readable tag, :func:`tagged`: ``[pd-error kind=invalid param=max_tokens] ...``
(``kind``: invalid, overloaded, internal; ``param`` and ``code`` only when known). An ensemble
prefixes the failing step's message (``in ensemble 'ensemble', ``), so :func:`parse_tag` takes
the first tag in the text: the one of the stage that answered the client (a message relayed
from another server, e.g. a prefill server's answer to a router, comes after it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

INVALID, OVERLOADED, INTERNAL = "invalid", "overloaded", "internal"
KINDS = (INVALID, OVERLOADED, INTERNAL)


class InvalidRequest(ValueError):
    """The client's request is invalid; ``param``: the client (ensemble) input at fault."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's code for it


class Overloaded(RuntimeError):
    """Retry later: the stage is at its queue bound or the request waited too long."""

    def __init__(self, message: str):
        super().__init__(f"overloaded, retry later: {message}")


INCOMPATIBLE_DEPLOYMENT = "incompatible_deployment"  # code family of Incompatible's tag


class Incompatible(RuntimeError):
    """A peer of another deployment; ``reason``: what differs (kvtransfer's REASONS label:
    protocol, secret, model, draft, kv; ``other``)."""

    def __init__(self, message: str, reason: str = "other"):
        super().__init__(message)
        self.reason = reason


def kind_of(exc: BaseException) -> str:
    """The client-facing error kind of an exception (by its type only)."""
    if isinstance(exc, Overloaded):
        return OVERLOADED
    if isinstance(exc, InvalidRequest):
        return INVALID
    return INTERNAL


_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_TAG = re.compile(
    r"\[pd-error kind=(\w+)(?: param=([A-Za-z_][\w.]*))?(?: code=([A-Za-z_][\w.]*))?\] ?"
)


def tagged(message: str, kind: str, param: str | None = None, code: str | None = None) -> str:
    """``message`` with its machine-readable tag in front (module docstring)."""
    kind = kind if kind in KINDS else INTERNAL
    extra = "".join(
        f" {k}={v}" for k, v in (("param", param), ("code", code)) if v and _WORD.fullmatch(v)
    )
    return f"[pd-error kind={kind}{extra}] {message}"


def tag_of(exc: BaseException) -> dict:
    """The tag fields of an exception: its kind, and an InvalidRequest's param and code."""
    if isinstance(exc, InvalidRequest):
        return {"kind": INVALID, "param": exc.param, "code": exc.code}
    if isinstance(exc, Incompatible):
        return {"kind": INTERNAL, "code": f"{INCOMPATIBLE_DEPLOYMENT}.{exc.reason}"}
    return {"kind": kind_of(exc)}


@dataclass(frozen=True)
class Tag:
    kind: str  # INVALID / OVERLOADED / INTERNAL; INTERNAL for a message without a tag
    param: str | None
    code: str | None
    message: str  # the text without its tags
    tagged: bool = True  # False: no stage answered; Triton itself failed the request


def parse_tag(text: str) -> Tag:
    """The kind, param and code of the first tag in ``text`` (an error a client received)."""
    m = _TAG.search(text)
    if m is None or m.group(1) not in KINDS:
        return Tag(INTERNAL, None, None, text, tagged=False)
    return Tag(m.group(1), m.group(2), m.group(3), _TAG.sub("", text))


def incompatible_reason(tag: Tag) -> str | None:
    """What differs when ``tag`` is an :class:`Incompatible` refusal (its code), else None."""
    family, _, reason = (tag.code or "").partition(".")
    return (reason or "other") if family == INCOMPATIBLE_DEPLOYMENT else None
