"""Prefill router (no Triton): a decode server's prefill step, forwarding to prefill servers.

Routing by load: each request goes to the *up* prefill server with the fewest queued prompt
tokens, learnt from the servers themselves::

    load(s) = queued(s) + sum(prompt tokens of this router's requests on s dispatched after
                              queued(s) was read)

``queued(s)`` is the server's ``pd_queued_prompt_tokens`` metric (every prefill instance's
waiting and computing prompts, from every router that uses it), read every
``probe_interval_s``; the second term counts what this router sent since, so a burst between
two reads spreads over the servers instead of piling onto the one that looked idle. Ties go to
the server that took fewer requests.

Each server is ``Up``, ``Down`` or ``Incompatible`` (:mod:`.servers`). A forward the server
refused with an error response moves on to the next server without marking it down. What the
refusal was is read from its error's tag (:mod:`..errors`), never from its words:

* ``overloaded``: try the next server; when every server refused so, the request is
  ``errors.Overloaded`` (retry later);
* ``invalid``: the request itself is at fault, and every server of this deployment would say so:
  ``errors.InvalidRequest`` at once, with the server's param and code;
* code ``incompatible_deployment.<what differs>``: that server is of another deployment, marked
  ``Incompatible`` (counted by what differs);
* anything else (internal, or a broken call: ``down``): the next server.

:meth:`PrefillRouter.dispatch` tries the servers in load order until one answers, and raises
:class:`NoPrefillServer` naming every server's reason only when none is left.

Readiness: the router is ready while some prefill server is ``Up`` or it may prefill locally;
every change is logged with each server's reason and exported as ``pd_ready``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from kvtransfer import Fingerprint

from .. import errors
from ..fingerprint import to_param
from ..request import StageRequest
from .client import PrefillClient, Refused
from .prefix_index import PrefixIndex, prompt_blocks
from .servers import PrefillServer, ServerState, identity_mismatch, resolve

__all__ = ["LOCAL", "NoPrefillServer", "PrefillRouter"]

log = logging.getLogger(__name__)

OnEnd = Callable[[str | None], None]
LOCAL = "local"  # bootstrap address of a request the decode server prefills itself
RESOLVE_EVERY = 10  # poll rounds between DNS look-ups of the prefill servers' host names
MAX_PENDING = 256  # requests waiting for a prefill server's answer (submit), all together


class NoPrefillServer(RuntimeError):
    """No prefill server took the request; the message names each one's reason."""


class _EndOnce:
    """Runs ``on_end(error)`` once, and only after :meth:`open` (the answer was delivered): a
    forward that ends before (or without) its answer reaches the caller some other way."""

    def __init__(self, on_end: OnEnd | None):
        self.on_end, self.opened, self.ended = on_end, False, None
        self.lock = threading.Lock()

    def end(self, err: str | None) -> None:
        with self.lock:
            if not self.opened:
                self.ended = (err,)
                return
        self._call(err)

    def open(self) -> None:
        with self.lock:
            self.opened, ended = True, self.ended
        if ended is not None:
            self._call(ended[0])

    def _call(self, err: str | None) -> None:
        if self.on_end is not None:
            self.on_end(err)


ROUTE_POLICIES = ("cache", "queue")


class PrefillRouter:
    def __init__(
        self,
        servers: list[tuple[str, int, int]],
        route_timeout_s: float = 10.0,
        probe_interval_s: float = 0.5,
        name: str = "router",
        client=PrefillClient,  # (host, grpc_port, metrics_port) -> client (tests pass fakes)
        local_max_tokens: int = 0,
        local_busy_tokens: int = 0,
        fingerprint: Fingerprint | None = None,  # ours: prefill servers must match
        page_size: int = 0,  # > 0: weigh the prefix each server likely caches (cache-aware)
        route_policy: str = "cache",  # "cache": queue + uncached prompt tokens; "queue"
        decode_caches: bool = False,  # the decode server beside it keeps a prefix cache
    ):
        self.fingerprint = fingerprint
        self.refusals: dict[str, int] = {}  # servers found incompatible, by reason
        self._was_ready: bool | None = None
        self.local_max_tokens, self.local_busy_tokens = local_max_tokens, local_busy_tokens
        if route_policy not in ROUTE_POLICIES:
            raise ValueError(f"route_policy must be one of {ROUTE_POLICIES}, got {route_policy!r}")
        self.page_size, self.route_policy = page_size, route_policy
        # what this decode server's own cache likely holds (None: it keeps none)
        self.decode_prefix = PrefixIndex() if decode_caches else None
        if not servers and not (local_max_tokens or local_busy_tokens):
            raise ValueError("the router needs at least one prefill server (prefill_servers)")
        self.route_timeout_s, self.probe_interval_s = route_timeout_s, probe_interval_s
        self.name = name
        self.specs, self.client = list(servers), client
        self.servers: list[PrefillServer] = []
        self._lock = threading.Lock()
        self._refresh()
        self._stop = threading.Event()
        self.counters = dict.fromkeys(("requests", "routed", "no_server", "loop_errors"), 0)
        self.local_counters = dict.fromkeys(("dispatched", "tokens", "hit_tokens"), 0)
        self._pending = 0
        self._pool = ThreadPoolExecutor(16, thread_name_prefix=f"{name}-dispatch")
        self._thread = threading.Thread(target=self._poll_loop, name=f"{name}-poll", daemon=True)
        self._thread.start()

    def submit(
        self,
        req: StageRequest,
        on_routed: Callable[[StageRequest], None],
        on_error: Callable[[Exception], None],
        on_end: OnEnd | None = None,
    ) -> None:
        """:meth:`dispatch` on the router's threads: ``on_routed(request)`` once a server
        answered, else ``on_error(exception)``; raises errors.Overloaded past MAX_PENDING."""
        with self._lock:
            if self._pending >= MAX_PENDING:
                raise errors.Overloaded(f"{self._pending} requests wait for a prefill server")
            self._pending += 1

        def run() -> None:
            try:
                self.dispatch(req, on_end, deliver=on_routed)
            except Exception as e:
                self._tell(on_error, e, req.room)
            finally:
                with self._lock:
                    self._pending -= 1

        self._pool.submit(run)

    def _tell(self, on_error: Callable[[Exception], None], e: Exception, room: int) -> None:
        """``on_error(e)`` on a dispatch thread: if it raises too (the client's response sender
        is closed), the request has nobody left to answer; say so, never silently."""
        try:
            on_error(e)
        except Exception:
            log.exception("%s: room %d: its error (%s) could not be delivered", self.name, room, e)

    # ---- routing (any thread) ----------------------------------------------------------------
    def order(
        self, exclude: set[str] = frozenset(), blocks: list[bytes] | None = None
    ) -> list[PrefillServer]:
        """Up servers not in ``exclude``, cheapest first: the tokens queued there plus, with
        the ``cache`` policy, the prompt tokens (``blocks``: its block hashes) it would compute
        (those it likely does not cache); least loaded first with ``queue``."""
        with self._lock:
            up = [s for s in self.servers if s.state == ServerState.Up and s.name not in exclude]
            return sorted(up, key=lambda s: (self._cost(s, blocks), s.counters["dispatched"]))

    def _cost(self, s: PrefillServer, blocks: list[bytes] | None) -> float:
        if self.route_policy != "cache" or not blocks:
            return s.load()
        return s.load() - self._hit(s, blocks)  # + the prompt's tokens: the same everywhere

    def _hit(self, s: PrefillServer, blocks: list[bytes]) -> int:
        """Prompt tokens server ``s`` likely caches (0 when its instances keep no cache)."""
        if not getattr(s.client, "caches", True):
            return 0
        return s.prefix.hit_blocks(blocks) * self.page_size

    def dispatch(
        self,
        req: StageRequest,
        on_end: OnEnd | None = None,
        exclude: set[str] = frozenset(),
        deliver: Callable[[StageRequest], None] | None = None,
    ) -> tuple[StageRequest, str]:
        """Forward ``req`` to the least loaded prefill server that takes it; returns (the
        request with that server's bootstrap address, the server's name). Blocks until the
        server answered (at most ``route_timeout_s`` per server tried). ``deliver(request)``
        runs with the answer first; then, once, ``on_end(error)`` when prefill is done with the
        room (error None) or the server was lost (never for a server that did not answer)."""
        self.counters["requests"] += 1
        blocks = prompt_blocks(req.prompt_ids, self.page_size)
        with self._lock:
            here = self._decode_hit(blocks)
        if self._prefill_here(len(req.prompt_ids) - here):  # what decode would compute
            return self._local(req, on_end, deliver, blocks, here)
        reasons: dict[str, str] = {}
        overloaded: set[str] = set()  # servers that refused as overloaded
        tried: set[str] = set(exclude)
        while True:
            cands = self.order(tried, blocks)
            if not cands:
                break
            s = cands[0]
            tried.add(s.name)
            try:
                routed = self._forward(s, req, on_end, deliver)
                self.counters["routed"] += 1
                with self._lock:
                    s.counters["hit_tokens"] += self._hit(s, blocks)
                    s.prefix.add(blocks)
                    self._decode_holds(blocks)  # its KV lands in decode's cache too
                return routed, s.name
            except Refused as e:
                reasons[s.name] = str(e)
                with self._lock:
                    s.counters["refused"] += 1
                differs = errors.incompatible_reason(e.tag)
                if differs is not None:
                    self._mark_incompatible(s, str(e), differs)
                elif e.tag.kind == errors.INVALID and not e.down:
                    raise errors.InvalidRequest(
                        f"prefill server {s.name}: {e.tag.message}", e.tag.param, e.tag.code
                    ) from e
                elif e.tag.kind == errors.OVERLOADED and not e.down:
                    overloaded.add(s.name)
                elif e.down:
                    self._mark_down(s, str(e))
        if self.local:  # nothing left to forward to, but this server can prefill
            return self._local(req, on_end, deliver, blocks, here)
        self.counters["no_server"] += 1
        raise self._no_server(reasons, exclude, overloaded)

    def _decode_hit(self, blocks: list[bytes]) -> int:
        """Prompt tokens decode's own cache likely holds (0 when it keeps none)."""
        if self.decode_prefix is None:
            return 0
        return self.decode_prefix.hit_blocks(blocks) * self.page_size

    def _decode_holds(self, blocks: list[bytes]) -> None:
        if self.decode_prefix is not None:
            self.decode_prefix.add(blocks)

    @property
    def local(self) -> bool:
        """Conditional disaggregation is on: some prompts are prefilled by the decode server."""
        return bool(self.local_max_tokens or self.local_busy_tokens)

    def _prefill_here(self, n: int) -> bool:
        """Prompts of which decode would compute at most ``local_max_tokens`` (``n``: the
        tokens its cache likely lacks, so a long prompt whose prefix decode holds stays here),
        and every prompt while all prefill servers are busy (or down)."""
        if n <= self.local_max_tokens:
            return True
        if not self.local_busy_tokens:
            return False
        up = self.order()
        return not up or up[0].load() > self.local_busy_tokens

    def _local(
        self, req: StageRequest, on_end, deliver, blocks: list[bytes], here: int
    ) -> tuple[StageRequest, str]:
        with self._lock:
            self.local_counters["dispatched"] += 1
            self.local_counters["tokens"] += len(req.prompt_ids)
            self.local_counters["hit_tokens"] += here
            self._decode_holds(blocks)
        routed = req.with_bootstrap(LOCAL)
        if deliver is not None:
            deliver(routed)
        if on_end is not None:
            on_end(None)  # nothing runs here: decode prefills it in its own engine
        return routed, LOCAL

    def _no_server(self, reasons: dict[str, str], exclude, overloaded: set[str]) -> Exception:
        """The error of a request no server took: ``errors.Overloaded`` when every server
        refused it as overloaded (retry later), else :class:`NoPrefillServer`."""
        with self._lock:
            for s in self.servers:
                if s.name not in reasons:
                    why = "excluded (failed this request)" if s.name in exclude else s.reason
                    incompatible = s.state == ServerState.Incompatible and s.name not in exclude
                    reasons[s.name] = why if incompatible else f"down: {why}"
        listed = "; ".join(f"{k}: {v}" for k, v in reasons.items())
        msg = f"no prefill server took the request ({listed})"
        if reasons and set(reasons) == overloaded:
            return errors.Overloaded(msg)
        return NoPrefillServer(msg)

    def _forward(self, s: PrefillServer, req: StageRequest, on_end, deliver):
        box = _EndOnce(on_end)

        def ended(err: str | None, down: bool) -> None:
            with self._lock:
                s.outstanding.pop(req.room, None)
            if down:
                with self._lock:
                    s.counters["lost"] += 1
                self._mark_down(s, f"lost during a request: {err}")
            box.end(err)

        n = len(req.prompt_ids)
        with self._lock:
            s.outstanding[req.room] = (n, time.monotonic())
        try:
            fwd = s.client.forward(req, ended)
            routed = fwd.answer(self.route_timeout_s)
        except Refused:
            with self._lock:
                s.outstanding.pop(req.room, None)
            raise
        with self._lock:
            s.counters["dispatched"] += 1
            s.counters["tokens"] += n
        if deliver is not None:
            deliver(routed)
        box.open()
        return routed

    # ---- health and load ---------------------------------------------------------------------
    def _mark_down(self, s: PrefillServer, reason: str) -> None:
        with self._lock:
            if s.state == ServerState.Down:
                return
            s.state, s.reason = ServerState.Down, reason
        log.warning("%s: prefill server %s marked down: %s", self.name, s.name, reason)

    def _mark_incompatible(self, s: PrefillServer, reason: str, differs: str) -> None:
        """``differs``: what differs (a label of kvtransfer's REASONS), counted in refusals."""
        with self._lock:
            if s.state == ServerState.Incompatible and s.reason == reason:
                return
            s.state, s.reason = ServerState.Incompatible, reason
            self.refusals[differs] = self.refusals.get(differs, 0) + 1
        log.error("%s: prefill server %s is not routed to: %s", self.name, s.name, reason)

    def _poll_one(self, s: PrefillServer) -> None:
        timeout = max(self.route_timeout_s / 4, 0.2)
        if s.state != ServerState.Up and not s.client.ready(timeout):
            return
        t = time.monotonic()
        try:
            queued = s.client.queued_tokens(timeout)
        except Exception as e:
            self._mark_down(s, f"metrics unreachable: {e}")
            return
        got = identity_mismatch(self.fingerprint, s)
        if got is not None:
            differs, why = got
            self._mark_incompatible(s, why, differs)
            return
        with self._lock:
            s.queued, s.read_at = queued, t
            if s.state != ServerState.Up:
                s.state, s.reason = ServerState.Up, ""
                log.warning("%s: prefill server %s is up again", self.name, s.name)

    def _refresh(self) -> None:
        """(Re)resolve the configured hosts: a DNS name with several addresses (a Kubernetes
        headless Service) is one prefill server per address. New addresses join (Up); gone ones
        leave once nothing of this router runs there."""
        want = {}
        for host, grpc_port, metrics_port in self.specs:
            for ip in resolve(host):
                want[f"{ip}:{grpc_port}"] = (ip, grpc_port, metrics_port)
        with self._lock:
            have = {s.name: s for s in self.servers}
            gone = [s for n, s in have.items() if n not in want and not s.outstanding]
            new = [PrefillServer(self.client(*want[n])) for n in want if n not in have]
            for x in new:
                x.client.fingerprint = to_param(self.fingerprint)
            self.servers = [s for s in self.servers if s not in gone] + new
        for s in gone:
            s.client.close()
        if new or gone:
            log.warning("%s: prefill servers now %s", self.name, [s.name for s in self.servers])

    def _poll_loop(self) -> None:
        rounds = 0
        while not self._stop.wait(self.probe_interval_s):
            rounds += 1
            if rounds % RESOLVE_EVERY == 0:
                try:
                    self._refresh()
                except Exception:
                    self.counters["loop_errors"] += 1
                    log.exception("%s: resolving the prefill servers failed", self.name)
            for s in list(self.servers):
                try:
                    self._poll_one(s)
                except Exception:  # the loop never dies
                    self.counters["loop_errors"] += 1
                    log.exception("%s: polling %s failed", self.name, s.name)
            self._log_readiness()

    # ---- readiness ---------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """Some prefill server takes requests, or this server may prefill them itself."""
        with self._lock:
            return self.local or any(s.state == ServerState.Up for s in self.servers)

    def readiness(self) -> str:
        """Each server's state and reason, for logs and errors."""
        with self._lock:
            return "; ".join(
                f"{s.name}: {s.state.name.lower()}" + (f" ({s.reason})" if s.reason else "")
                for s in self.servers
            )

    def _log_readiness(self) -> None:
        ready = self.ready
        if ready == self._was_ready:
            return
        self._was_ready = ready
        if ready:
            log.warning("%s: ready: a prefill server is up (%s)", self.name, self.readiness())
        else:
            log.error(
                "%s: NOT READY: no compatible prefill server is up and local prefill is off (%s)",
                self.name,
                self.readiness(),
            )

    # ---- metrics -----------------------------------------------------------------------------
    def stats(self) -> dict:
        """Per-server state and counters (for metrics), plus the router's own counters."""
        with self._lock:
            per = {
                s.name: {
                    "up": int(s.state == ServerState.Up),
                    "incompatible": int(s.state == ServerState.Incompatible),
                    "load": s.load(),
                    "queued": s.queued,
                    "outstanding": len(s.outstanding),
                    **s.counters,
                }
                for s in self.servers
            }
            if self.local:
                keys = ("up", "incompatible", "load", "queued", "outstanding", "refused", "lost")
                keys += ("hit_tokens",)
                zero = dict.fromkeys(keys, 0)
                per[LOCAL] = {**zero, "up": 1, **self.local_counters}
        return {"servers": per, **self.counters}

    def stage_stats(self) -> dict:
        """The router's stage-level metrics: readiness and refusals by reason."""
        with self._lock:
            refusals = dict(self.refusals)
        return {"ready": int(self.ready), "refusals": refusals}

    def close(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._thread.join(timeout=2)
        for s in self.servers:
            s.client.close()
