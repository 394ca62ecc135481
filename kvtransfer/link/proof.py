"""Proof that a decode peer owns the Mooncake session it registers pages of.

A Register names a Mooncake session (``host:port``) and addresses in it, and prefill then
writes KV there. Without a proof, a peer could name ANOTHER decode's session and turn this
prefill into a writer into that victim's memory (HMAC only proves the peer has the secret).

* decode (:class:`SessionToken`): a random 32-byte token in a small buffer registered with its
  own engine; every Register carries the token and that buffer's address.
* prefill (:class:`ProofChecker`): before it serves a connection's first registration, it reads
  32 bytes from the named session at that address (a Mooncake read) and compares them with the
  token the connection sent. A peer naming a session it does not own cannot know the token in
  it. Checks run on a few worker threads (each with its own registered scratch buffer), never
  on the control thread, so one peer naming an unreachable session stalls one worker only.
"""

from __future__ import annotations

import ctypes
import hmac
import logging
import queue
import secrets
import threading
from collections.abc import Callable

from .engine import Engine

log = logging.getLogger(__name__)

TOKEN_BYTES = 32


class SessionToken:
    """decode's token, in memory its engine registered (prefill reads it through Mooncake)."""

    def __init__(self, engine: Engine):
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self._buf = (ctypes.c_char * TOKEN_BYTES).from_buffer_copy(self.token)
        self.addr = ctypes.addressof(self._buf)
        engine.register(self.addr, TOKEN_BYTES)


Verdict = Callable[[bytes, bool, str], None]  # (connection identity, proven, why not)


class ProofChecker:
    WORKERS = 4

    def __init__(self, engine: Engine):
        self.engine = engine
        self._jobs: queue.Queue = queue.Queue(maxsize=1024)
        self._threads = []
        for i in range(self.WORKERS):
            buf = (ctypes.c_char * TOKEN_BYTES)()
            engine.register(ctypes.addressof(buf), TOKEN_BYTES)
            t = threading.Thread(target=self._run, args=(buf,), name=f"kv-proof-{i}", daemon=True)
            self._threads.append(t)
            t.start()

    def check(self, ident: bytes, session: str, addr: int, token: bytes, verdict: Verdict):
        """Queue a check; ``verdict`` runs on the checker's thread. False when too many wait."""
        try:
            self._jobs.put_nowait((ident, session, addr, token, verdict))
            return True
        except queue.Full:
            return False

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join(timeout=5)

    def _run(self, buf) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            ident, session, addr, token, verdict = job
            try:
                ok, why = self._prove(buf, session, addr, token)
            except Exception as e:  # never kills the thread
                ok, why = False, f"proof check failed ({type(e).__name__}: {e})"
            try:
                verdict(ident, ok, why)
            except Exception:
                log.exception("kv-proof: verdict callback failed")

    def _prove(self, buf, session: str, addr: int, token: bytes) -> tuple[bool, str]:
        if len(token) != TOKEN_BYTES or addr <= 0:
            return False, "the Register carries no session proof"
        ctypes.memset(buf, 0, TOKEN_BYTES)
        if not self.engine.read_sync(session, ctypes.addressof(buf), addr, TOKEN_BYTES):
            return False, f"could not read the session proof from {session}"
        if not hmac.compare_digest(bytes(buf), token):
            return False, f"the connection does not own session {session}"
        return True, ""
