"""The strength rule for a deployment's secrets: the stages' shared HMAC secret and the OpenAI
front's API keys. One rule, used by the stages (:class:`~.params.StageParams`), the front
(``backends/openai/auth.py``) and ``scripts/serve.sh`` (``python -m backends.stages.keys``).

A value is refused when, leading and trailing whitespace removed, it

* is a placeholder: it contains ``replace-me`` (the value ``deploy/kubernetes/secret.yaml``
  ships is one), so a manifest applied as shipped can never sign messages with a publicly known key;
* is shorter than ``MIN_LENGTH`` (16) characters;
* has fewer than ``MIN_DISTINCT`` (8) different characters (``xxxx...``, ``abab...``);
* is a shorter piece repeated (``abcdefgh`` twice).

``openssl rand -hex 32`` (64 hex digits) passes: 64 random hex digits have fewer than 8
different ones with a probability far below 1e-12 (16 random hex digits: about 1%, hence the advice
of 32 bytes). The rule catches the usual mistakes, it does not measure entropy: a value that
passes can still be guessable (``0123456789abcdef``); make it with a random generator.

A leaf (standard library only): the front and serve.sh import it without the stages' runtime.
"""

from __future__ import annotations

import sys

MIN_LENGTH, MIN_DISTINCT = 16, 8
PLACEHOLDER = "replace-me-with-openssl-rand-hex-32"  # what deploy/kubernetes/secret.yaml ships
HOW = "make one with `openssl rand -hex 32`"


def weakness(value: str | bytes) -> str | None:
    """Why ``value`` is not acceptable as a secret or an API key, or None when it is."""
    raw = value.encode() if isinstance(value, str) else bytes(value)
    raw = raw.strip()
    if b"replace-me" in raw.lower():
        return "is the placeholder that deploy/kubernetes/secret.yaml ships, not a secret"
    if len(raw) < MIN_LENGTH:
        return f"is too short: {len(raw)} characters, at least {MIN_LENGTH} are needed"
    distinct = len(set(raw))
    if distinct < MIN_DISTINCT:
        return f"has only {distinct} different characters (at least {MIN_DISTINCT} are needed)"
    period = _period(raw)
    if period < len(raw):
        return f"is one piece of {period} characters repeated"
    return None


def _period(raw: bytes) -> int:
    """The shortest ``p`` dividing ``len(raw)`` with ``raw == raw[:p] * (len(raw) // p)``."""
    n = len(raw)
    return next(p for p in range(1, n + 1) if n % p == 0 and raw[:p] * (n // p) == raw)


def refuse_weak(value: str | bytes, what: str) -> None:
    """ValueError naming ``what`` and how to make a good one, when ``value`` is weak."""
    why = weakness(value)
    if why is not None:
        raise ValueError(f"{what} {why}: {HOW}")


def main(argv: list[str]) -> int:
    """``python -m backends.stages.keys WHAT < FILE``: exit 2 with the reason when the value on
    stdin (all whitespace removed, as serve.sh reads a secret file) is weak; WHAT names it in the
    message. The value comes on stdin, never on a command line other users can list."""
    if len(argv) != 1:
        print("usage: python -m backends.stages.keys WHAT < FILE", file=sys.stderr)
        return 2
    value = b"".join(sys.stdin.buffer.read().split())
    try:
        refuse_weak(value, argv[0])
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
