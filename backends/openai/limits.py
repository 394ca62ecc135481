"""Bounded request bodies: a size limit checked before anything is parsed, a JSON nesting limit,
and JSON as the standard has it (no ``NaN`` / ``Infinity``).

* Size: a ``Content-Length`` over the limit is a 413 before one byte of the body is read; a
  body without one (chunked) is counted while it is read and refused with a 413 as soon as it
  passes the limit. Default: :data:`MAX_BODY_BYTES` (4 MiB), or 64 bytes a token of the
  server's context when that is more (``--max-context``), so a full context of text (JSON
  escapes included) always fits.
* Nesting: brackets outside strings are counted on the raw bytes before the parser sees them
  (one regular expression and a cumulative sum): deeper than :data:`MAX_DEPTH` (32) is a 400,
  never a ``RecursionError``. The deepest valid request is a few levels deep (a chat message's
  content parts).
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
from starlette.requests import Request

from .errors import APIError, invalid

MAX_BODY_BYTES = 4 << 20
BYTES_PER_CONTEXT_TOKEN = 64
MAX_DEPTH = 32

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1 / -1 as int8


def body_limit(max_body_bytes: int = 0, max_context: int = 0) -> int:
    """The body limit in effect: the one given, else the default for this context."""
    return max_body_bytes or max(MAX_BODY_BYTES, BYTES_PER_CONTEXT_TOKEN * max_context)


def _too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the request body is larger than this server's limit of {limit} bytes"
        " (the front's --max-body-bytes)",
    )


async def read_body(http: Request, limit: int) -> bytes:
    """The body, or APIError 413 as soon as it is known to pass ``limit`` bytes."""
    length = http.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise invalid(f"bad Content-Length {length[:40]!r}")
        if int(length) > limit:
            raise _too_large(limit)
    body = bytearray()
    async for chunk in http.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(limit)
    return bytes(body)


def depth(body: bytes) -> int:
    """The deepest nesting of ``[`` / ``{`` outside JSON strings in ``body``."""
    brackets = _STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    steps = np.frombuffer(brackets.translate(_STEP), dtype=np.int8)
    return int(np.cumsum(steps, dtype=np.int64).max())


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_json(body: bytes, max_depth: int = MAX_DEPTH) -> Any:
    """``body`` as JSON, or APIError 400 (not JSON, nested deeper than ``max_depth``)."""
    if depth(body) > max_depth:
        raise invalid(f"the request body nests deeper than {max_depth} levels")
    try:
        return json.loads(body, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError included
        raise invalid(f"the request body is not JSON: {e}") from None


async def read_json(http: Request, limit: int, max_depth: int = MAX_DEPTH) -> Any:
    return parse_json(await read_body(http, limit), max_depth)
