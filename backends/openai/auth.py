"""API keys of the front: every ``/v1/*`` route needs ``Authorization: Bearer KEY`` when keys
are set; ``/health`` stays open for probes.

Keys come from ``--api-key-file FILE`` (else ``$PD_API_KEY_FILE``): one key a line, blank lines
and ``#`` comments skipped, so that a key can be rotated by serving the old and the new one for
a while; and from ``$PD_API_KEY`` (one key, e.g. a Kubernetes Secret as an environment
variable). Each key must pass the deployment secrets' strength rule
(``backends/stages/keys.py``: the manifest's placeholder and short or patterned keys are
refused at start). A presented key is compared with every key in constant time
(``hmac.compare_digest``), so neither the answer nor its time tells which key, or how much of
one, matched.

A front that listens on an address other than loopback refuses to start without a key, unless
told ``--insecure-no-api-key`` (``$PD_INSECURE_NO_API_KEY=1``: e.g. behind a proxy that
authenticates); on loopback it serves without one, as the quick start and the tests do.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Mapping

from ..stages.keys import HOW, refuse_weak
from .errors import APIError

KEY_ENV, KEY_FILE_ENV, NO_KEY_ENV = "PD_API_KEY", "PD_API_KEY_FILE", "PD_INSECURE_NO_API_KEY"


def load_keys(path: str | None = None, env: Mapping[str, str] = os.environ) -> tuple[bytes, ...]:
    """The API keys of ``path`` (else ``$PD_API_KEY_FILE``) and ``$PD_API_KEY``; ValueError
    naming the place of a weak key or an empty file."""
    keys: list[tuple[str, str]] = []  # (where, key)
    path = path or env.get(KEY_FILE_ENV) or None
    if path:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
        for i, line in enumerate(lines, 1):
            key = line.split("#", 1)[0].strip()
            if key:
                keys.append((f"the API key on line {i} of {path}", key))
        if not keys:
            raise ValueError(f"API key file {path} holds no key (one a line): {HOW}")
    if env.get(KEY_ENV, "").strip():
        keys.append((f"the API key in ${KEY_ENV}", env[KEY_ENV].strip()))
    for where, key in keys:
        refuse_weak(key, where)
    return tuple(key.encode() for _, key in keys)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def check_binding(host: str, keys: tuple[bytes, ...], insecure: bool) -> None:
    """ValueError when the front would serve a non-loopback address without a key."""
    if keys or insecure or is_loopback(host):
        return
    raise ValueError(
        f"the OpenAI front would listen on {host}, which is not a loopback address, without an"
        f" API key: give --api-key-file FILE (one key a line) or ${KEY_FILE_ENV} / ${KEY_ENV};"
        f" {HOW}. Clients then send 'Authorization: Bearer KEY'. Serving without a key there"
        f" needs --insecure-no-api-key (${NO_KEY_ENV}=1), e.g. behind an authenticating proxy"
    )


class APIKeys:
    def __init__(self, keys: tuple[bytes, ...] = ()):
        self.keys = keys

    def check(self, authorization: str | None) -> None:
        """Nothing when no key is set or ``authorization`` (the header) carries one of them;
        else APIError 401."""
        if not self.keys:
            return
        scheme, _, token = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise APIError(
                401,
                "this server needs an API key: send the header 'Authorization: Bearer KEY'",
                code="missing_api_key",
            )
        presented = token.strip().encode()
        match = False
        for key in self.keys:  # every key, whatever matched: the time tells nothing
            match |= hmac.compare_digest(key, presented)
        if not match:
            raise APIError(401, "invalid API key", code="invalid_api_key")
