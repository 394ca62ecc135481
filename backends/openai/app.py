"""The routes: ``GET /health``, ``GET /v1/models``, ``POST /v1/chat/completions``,
``POST /v1/completions`` (streaming as server-sent events ending with ``data: [DONE]``).

Every ``/v1`` route checks the API key (:mod:`.auth`) before it reads the body, then reads the
body within its limits (:mod:`.limits`). Every failure is answered in OpenAI's error shape
(:mod:`.errors`): an unknown route too, and any exception a route lets out (a 500, logged with
its traceback). A stream that fails once it has begun sends the error as an event,
``data: {"error": {...}}``, then ``data: [DONE]``.

A request that Triton itself failed before any token (no stage's tag: a stage process that
died, whose instance fails what it gets until the supervisor's reload) is sent again, after
0.1 s and then twice as long each time (at most 1 s), within ``retry_window_s`` of its first
try; nothing reached the client yet, so it sees a slower answer, not an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid

import tritonclient.grpc.aio as aio
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from . import protocol as p
from .auth import APIKeys
from .errors import APIError, internal, overloaded
from .limits import body_limit, read_json
from .session import Chunk, Session

DISCONNECT_POLL_S = 0.25
RETRY_FIRST_S, RETRY_MAX_S = 0.1, 1.0  # the pauses between tries of a request Triton failed
log = logging.getLogger(__name__)


class Front:
    def __init__(
        self,
        grpc_url: str,
        names: tuple[str, ...],
        ensemble: str,
        max_inflight: int,
        keys: APIKeys,
        max_body_bytes: int,
        retry_window_s: float,
    ):
        self.grpc_url, self.names, self.ensemble = grpc_url, names, ensemble
        self.max_inflight, self.inflight = max_inflight, 0
        self.retry_window_s, self.retried = retry_window_s, 0  # tries sent again, in all
        self.keys, self.max_body_bytes = keys, max_body_bytes
        self.created = int(time.time())
        self.client: aio.InferenceServerClient | None = None

    async def ready(self) -> bool:
        try:
            return await self.client.is_server_ready() and await self.client.is_model_ready(
                self.ensemble
            )
        except Exception:
            return False

    async def run(self, kind: str, req, inputs: dict, http: Request):
        """Answer one request (JSON, or an SSE stream)."""
        if self.inflight >= self.max_inflight:
            raise overloaded(f"overloaded, retry later: {self.inflight} requests in flight")
        self.inflight += 1
        try:
            session, chunks, first = await self._start(req, inputs, http)
        except BaseException:
            self.inflight -= 1
            raise
        release = self._releaser(session)
        out = Answer(kind, req, self.names[0])
        if req.stream:
            # released by the stream's end, or by the background task when the client went
            # away before the stream began (the generator's own finally never runs then)
            return StreamingResponse(
                self._sse(out, first, chunks, release),
                media_type="text/event-stream",
                background=BackgroundTask(release),
            )
        try:
            out.add(first)
            while not first.finish_reason:
                first = await _watched(anext(chunks), session, http)
                out.add(first)
            return JSONResponse(out.whole())
        finally:
            release()

    async def _start(self, req, inputs: dict, http: Request):
        """The request's session, its chunks and the first chunk; a failure of Triton's own
        before it is tried again within ``retry_window_s`` (module docstring)."""
        deadline, pause = time.monotonic() + self.retry_window_s, RETRY_FIRST_S
        while True:
            session = Session(self.client, self.ensemble, inputs, p.fields_of(req), self.grpc_url)
            chunks = session.chunks()
            try:
                return session, chunks, await _watched(anext(chunks), session, http)
            except BaseException as e:
                session.cancel()
                triton_failed = isinstance(e, APIError) and e.from_triton
                if not triton_failed or time.monotonic() + pause > deadline:
                    raise
                if pause == RETRY_FIRST_S:  # one line a request, not one a try
                    log.warning("trying again a request Triton failed: %s", e.message)
            self.retried += 1
            await _watched(asyncio.sleep(pause), session, http)  # 499 if the client goes
            pause = min(2 * pause, RETRY_MAX_S)

    def _releaser(self, session: Session):
        """A callable that cancels ``session`` and frees its in-flight slot, once."""
        done = False

        def release() -> None:
            nonlocal done
            if not done:
                done = True
                self.inflight -= 1
                session.cancel()  # a client that went away cancels the request on the server

        return release

    async def _sse(self, out: Answer, first: Chunk, chunks, release):
        try:
            if out.kind == "chat":
                yield _event(out.chunk({"role": "assistant", "content": ""}, None, None))
            chunk = first
            while True:
                event = out.delta(chunk)
                if event is not None:
                    yield _event(event)
                if chunk.finish_reason:
                    break
                chunk = await anext(chunks)
            if out.include_usage:
                yield _event({**out.head("chunk"), "choices": [], "usage": out.usage()})
        except APIError as e:
            yield _event(e.body())
        except Exception as e:  # noqa: BLE001 - a stream always ends with an error event + [DONE]
            log.exception("stream %s failed", out.id)
            yield _event(internal(e).body())
        finally:
            release()
        yield "data: [DONE]\n\n"


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _watched(awaitable, session: Session, http: Request):
    """``awaitable``, cancelled (with the request on the server) if the client disconnects."""
    task = asyncio.ensure_future(awaitable)
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await http.is_disconnected():
            session.cancel()
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            raise APIError(499, "client disconnected")


class Answer:
    """The OpenAI answer built from the ensemble's chunks (chat or completion)."""

    def __init__(self, kind: str, req, model: str):
        self.kind, self.req, self.model = kind, req, model
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.text, self.ids, self.logprobs = "", [], []
        self.finish_reason, self.prompt_tokens, self.cached_tokens = None, 0, 0
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        # text_offset of the first generated token: after the echoed prompt
        echo = getattr(req, "echo", False) and isinstance(req.prompt, str)
        self.offset = len(req.prompt) if echo else 0

    def add(self, c: Chunk) -> None:
        self.text += c.text
        self.ids += c.token_ids
        self.logprobs += c.logprobs or []
        self.prompt_tokens, self.cached_tokens = c.num_input_tokens, c.num_cached_tokens
        self.finish_reason = c.finish_reason or None

    def usage(self) -> dict:
        n = len(self.ids)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": n,
            "total_tokens": self.prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def head(self, suffix: str = "") -> dict:
        obj = {"chat": "chat.completion", "completion": "text_completion"}[self.kind]
        if suffix and self.kind == "chat":
            obj += "." + suffix
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, delta, logprobs, finish_reason) -> dict:
        choice = {"index": 0, "logprobs": logprobs, "finish_reason": finish_reason}
        choice.update({"delta": delta} if self.kind == "chat" else {"text": delta})
        out = {**self.head("chunk"), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out

    def delta(self, c: Chunk) -> dict | None:
        self.add(c)
        lp = self._logprobs(c.token_ids, c.logprobs)
        if not (c.text or c.finish_reason or lp):
            return None
        delta = {"content": c.text} if self.kind == "chat" else c.text
        return self.chunk(delta, lp, c.finish_reason or None)

    def whole(self) -> dict:
        lp = self._logprobs(self.ids, self.logprobs)
        choice = {"index": 0, "logprobs": lp, "finish_reason": self.finish_reason}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": self.text}
        else:
            choice["text"] = self.text
        return {**self.head(), "choices": [choice], "usage": self.usage()}

    def _logprobs(self, ids: list[int], entries: list[dict] | None) -> dict | None:
        if not entries:
            return None
        n = self.req.top_logprobs or 0 if self.kind == "chat" else self.req.logprobs
        rows = []
        for token, entry in zip(ids, entries, strict=True):
            chosen = entry[str(token)]
            top = sorted(entry.values(), key=lambda e: e["rank"])[:n]
            rows.append((chosen, top))
        if self.kind == "chat":
            return {
                "content": [{**_lp(c), "top_logprobs": [_lp(t) for t in top]} for c, top in rows]
            }
        offsets = []
        for c, _ in rows:
            offsets.append(self.offset)
            self.offset += len(c["decoded_token"])
        return {
            "tokens": [c["decoded_token"] for c, _ in rows],
            "token_logprobs": [c["logprob"] for c, _ in rows],
            "top_logprobs": [{t["decoded_token"]: t["logprob"] for t in top} for _, top in rows],
            "text_offset": offsets,
        }


def _lp(e: dict) -> dict:
    tok = e["decoded_token"]
    return {"token": tok, "logprob": e["logprob"], "bytes": list(tok.encode("utf-8"))}


class OpenAIErrors:
    """ASGI middleware: an exception a route lets out becomes a 500 in OpenAI's shape, logged
    with its traceback, never Starlette's plain-text "Internal Server Error". (Once a response
    has begun nothing can be sent: the connection just ends; streams catch their own.)"""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def sending(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as e:  # noqa: BLE001 - every failure gets OpenAI's shape
            log.exception("%s %s failed", scope.get("method"), scope.get("path"))
            if not started:
                await internal(e).response()(scope, receive, send)


def create_app(
    grpc_url: str,
    names: tuple[str, ...],
    ensemble: str = "ensemble",
    max_inflight: int = 4096,
    keys: tuple[bytes, ...] = (),
    max_body_bytes: int = 0,
    retry_window_s: float = 30.0,
) -> FastAPI:
    """The front's app; ``keys``: API keys (none: no key needed); ``max_body_bytes``: the body
    limit (0: :func:`.limits.body_limit`'s default); ``retry_window_s``: how long a request
    Triton failed before any token is tried again (0: never)."""
    limit = body_limit(max_body_bytes)
    front = Front(grpc_url, names, ensemble, max_inflight, APIKeys(keys), limit, retry_window_s)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        front.client = aio.InferenceServerClient(grpc_url)
        yield
        await front.client.close()

    app = FastAPI(title="pd-triton OpenAI-compatible API", lifespan=lifespan)
    app.state.front = front
    app.add_middleware(OpenAIErrors)

    @app.exception_handler(APIError)
    async def _api_error(_request, e: APIError):
        return e.response()

    @app.exception_handler(HTTPException)
    async def _http_error(_request, e: HTTPException):  # unknown route, wrong method
        return APIError(e.status_code, str(e.detail)).response()

    @app.get("/health")
    async def health():
        ok = await front.ready()
        body = {"status": "ok" if ok else "not ready", "requests_in_flight": front.inflight,
                "requests_retried": front.retried}  # fmt: skip
        return JSONResponse(body, 200 if ok else 503)

    async def authorized(http: Request) -> None:
        front.keys.check(http.headers.get("authorization"))

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorized)])

    @v1.get("/models")
    async def models():
        data = [
            {"id": n, "object": "model", "created": front.created, "owned_by": "pd-triton"}
            for n in names
        ]
        return {"object": "list", "data": data}

    @v1.post("/chat/completions")
    async def chat(http: Request):
        req = p.parse(p.ChatRequest, await read_json(http, front.max_body_bytes))
        p.check_model(req.model, names)
        return await front.run("chat", req, p.chat_inputs(req), http)

    @v1.post("/completions")
    async def completions(http: Request):
        req = p.parse(p.CompletionRequest, await read_json(http, front.max_body_bytes))
        p.check_model(req.model, names)
        return await front.run("completion", req, p.completion_inputs(req), http)

    app.include_router(v1)
    return app
