"""The HTTP side of `nibble serve`: Starlette routes for the OpenAI API, server-sent events, the API
key, the body limit, and a client that leaves cancelling its reply.

Each loaded model's engine runs on a thread of its own; a handler takes the model its request
names (loading it if need be, runner/serve/models.py), submits the request and awaits its events,
which the engine thread hands to the event loop. When a client disconnects, Starlette cancels the
streamed response, or our watcher the handler awaiting a whole reply: either way the request is
cancelled as they unwind, and the engine frees the sequence at its next step.
"""
from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import AsyncIterator

import anyio
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from nibble.formats.errors import NibbleError
from ..engine import Busy, Event
from . import api
from .api import ApiError, Stamp
from .guard import Callers, Guard
from .models import Lease, Models
from .replies import ChatDeltas, Turn, chat_turn, completion_turn

MAX_BODY = 1 << 20   # bytes: a 32k-token conversation is ~130 KB of JSON


def make_app(models: Models, api_key: str | None = None, callers: Callers = Callers()) -> Starlette:
    """The OpenAI API over `models`, and ollama's /api/ps, for the callers `callers` allows (by
    default: requests to localhost, from no web page but loopback's); with `api_key`, every route
    but /health asks for it."""
    def route(path, handler, methods=("GET",), open=False):
        async def endpoint(request: Request) -> Response:
            try:
                if not open and api_key is not None and not _authorized(request, api_key):
                    raise ApiError(401, "wrong or missing API key: send it as 'Authorization: Bearer KEY'",
                                   code="invalid_api_key")
                return await handler(models, request)
            except ApiError as e:
                return error_response(e)
            except NibbleError as e:   # what the model cannot take, said by the library
                return error_response(ApiError(400, str(e)))
        return Route(path, endpoint, methods=list(methods))

    return Starlette(routes=[route("/v1/chat/completions", chat, ["POST"]),
                             route("/v1/completions", completions, ["POST"]),
                             route("/v1/models", list_models),
                             route("/api/ps", running),
                             route("/health", health, open=True)],
                     middleware=[Middleware(Guard, callers=callers, refuse=_forbidden)],
                     exception_handlers={HTTPException: _http_error, Exception: _server_error})


def _forbidden(scope, why: str) -> Response:
    return error_response(ApiError(403, why, code="forbidden"))


def error_response(e: ApiError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status == 503 else None
    return JSONResponse(e.body(), e.status, headers=headers)


async def chat(models: Models, request: Request) -> Response:
    body = api.parse_chat(await read_json(request))
    pending = await start(models, body, chat_turn)
    served = pending.served
    stamp, deltas = Stamp.new("chatcmpl", served.name), ChatDeltas(pending.turn.tool_names, served.family)
    if body.options.stream:
        return EventStream(chat_chunks(stamp, pending, deltas, body.options.include_usage), pending)
    with pending:
        return await until_disconnected(request, chat_reply(stamp, pending, deltas, body.options.logprobs))


async def completions(models: Models, request: Request) -> Response:
    body = api.parse_completion(await read_json(request))
    pending = await start(models, body, completion_turn)
    stamp = Stamp.new("cmpl", pending.served.name)
    if body.options.stream:
        return EventStream(text_chunks(stamp, pending, body.options.include_usage), pending)
    with pending:
        return await until_disconnected(request, text_reply(stamp, pending))


async def start(models: Models, body, make_turn) -> Pending:
    """The request submitted to the engine of the model it names, which it holds until its reply
    ends (the Pending's exit)."""
    lease = await models.lease(body.options.model)
    try:   # template, tokenizer, grammar: off the loop
        return Pending(lease, await run_in_threadpool(make_turn, lease.served, body))
    except BaseException:
        lease.release()
        raise


async def list_models(models: Models, request: Request) -> Response:
    return JSONResponse(api.models(list(models.refs), models.created))


async def running(models: Models, request: Request) -> Response:
    return JSONResponse(api.running_models(
        [api.running_model(s.name, s.details, s.size, s.engine.ctx, until) for s, until in models.loaded()]))


async def health(models: Models, request: Request) -> Response:
    engines = models.engines()
    return JSONResponse({"status": "ok", "running": sum(e.running for e in engines),
                         "waiting": sum(e.waiting for e in engines)})


class Pending:
    """A submitted request, its events arriving on the event loop (the engine emits on its thread).
    A reply that ends well is remembered for the next turn (Served.remember)."""

    def __init__(self, lease: Lease, turn: Turn):
        served = lease.served
        loop, self.events = asyncio.get_running_loop(), asyncio.Queue()

        def emit(event: Event):
            try:
                loop.call_soon_threadsafe(self.events.put_nowait, event)
            except RuntimeError:   # the loop has closed: the server stopped, nobody is waiting
                pass
        try:
            self.handle = served.engine.submit(turn.request, emit)
        except Busy as e:
            raise ApiError(503, f"{e}: try again in a moment", type="server_error", code="server_busy") from None
        self.lease, self.served, self.turn, self.done = lease, served, turn, False
        self.text, self.tokens = [], []   # the reply so far

    async def next(self) -> Event:
        event = await self.events.get()
        self.text.append(event.text)
        self.tokens += event.tokens
        self.done = event.finish_reason is not None
        if self.done:   # the engine is done with it: the model may go while the last chunks are sent
            self.lease.release()
        if event.finish_reason in ("stop", "length"):
            self.served.remember(self.turn, "".join(self.text), self.tokens)
        return event

    def __enter__(self) -> Pending:
        return self

    def __exit__(self, *exc):
        """Cancel the request unless it has finished (the client left, or the handler failed), and
        let go of its model."""
        if not self.done:
            self.served.engine.cancel(self.handle)
        self.lease.release()


async def chat_chunks(stamp: Stamp, pending: Pending, deltas: ChatDeltas, include_usage: bool) -> AsyncIterator[dict]:
    yield api.chat_chunk(stamp, {"role": "assistant", "content": ""})   # at once: the client sees a reply start
    while True:
        event = await pending.next()
        if event.finish_reason == "error":
            yield _failed(event).body()
            return
        out = deltas.feed(event) or ([{"content": ""}] if event.logprobs else [])
        for i, delta in enumerate(out):
            yield api.chat_chunk(stamp, delta, logprobs=event.logprobs if i == 0 else None)
        if event.finish_reason:
            yield api.chat_chunk(stamp, {}, deltas.finish_reason(event.finish_reason))
            if include_usage:
                yield api.usage_chunk(stamp, "chat.completion.chunk", event.usage)
            return


async def chat_reply(stamp: Stamp, pending: Pending, deltas: ChatDeltas, logprobs: int | None) -> Response:
    content, calls, tokens = [], [], []
    while True:
        event = await pending.next()
        if event.finish_reason == "error":
            return error_response(_failed(event))
        tokens += event.logprobs
        for delta in deltas.feed(event):
            content.append(delta.get("content", ""))
            calls += [{k: v for k, v in c.items() if k != "index"} for c in delta.get("tool_calls", ())]
        if event.finish_reason:
            break
    text = "".join(content)
    return JSONResponse(api.chat_completion(stamp, text if text or not calls else None, calls,
                                            deltas.finish_reason(event.finish_reason),
                                            tokens if logprobs is not None else None, event.usage))


async def text_chunks(stamp: Stamp, pending: Pending, include_usage: bool) -> AsyncIterator[dict]:
    offset = 0
    while True:
        event = await pending.next()
        if event.finish_reason == "error":
            yield _failed(event).body()
            return
        if event.text or event.logprobs or event.finish_reason:
            yield api.text_completion(stamp, event.text, event.finish_reason, event.logprobs, offset=offset)
        offset += len(event.text)
        if event.finish_reason:
            if include_usage:
                yield api.usage_chunk(stamp, "text_completion", event.usage)
            return


async def text_reply(stamp: Stamp, pending: Pending) -> Response:
    tokens = []
    while True:
        event = await pending.next()
        if event.finish_reason == "error":
            return error_response(_failed(event))
        tokens += event.logprobs
        if event.finish_reason:
            break
    return JSONResponse(api.text_completion(stamp, "".join(pending.text), event.finish_reason, tokens, event.usage))


def _failed(event: Event) -> ApiError:
    """A reply the engine could not go on with (NaN in the logits, say): a stream sends it as an
    error event, which the official client raises."""
    return ApiError(500, f"the reply failed: {event.error}", type="server_error")


class EventStream(StreamingResponse):
    """Server-sent events, one chunk each, then `data: [DONE]`. However the response ends (sent,
    the client gone, even before the first chunk), its request is cancelled unless it finished."""

    def __init__(self, chunks: AsyncIterator[dict], pending: Pending):
        async def events():
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
            yield "data: [DONE]\n\n"
        super().__init__(events(), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.pending = pending

    async def __call__(self, scope, receive, send):
        with self.pending:
            await super().__call__(scope, receive, send)


async def until_disconnected(request: Request, reply) -> Response:
    """Await `reply` (a coroutine), cancelled if the client disconnects first: Starlette notices
    a disconnect only while it streams a response."""
    response = Response(status_code=499)   # for nobody: the client has gone
    async with anyio.create_task_group() as tasks:
        async def watch():
            while (await request.receive())["type"] != "http.disconnect":
                pass
            tasks.cancel_scope.cancel()
        tasks.start_soon(watch)
        response = await reply
        tasks.cancel_scope.cancel()
    return response


async def read_json(request: Request):
    """The body as JSON, at most MAX_BODY bytes: 413 past it (read no further), 400 if not JSON,
    nested past Python's recursion limit, or holding text that is not Unicode."""
    too_large = ApiError(413, f"the request body is over {MAX_BODY} bytes", code="request_too_large")
    try:
        if int(request.headers.get("content-length") or 0) > MAX_BODY:
            raise too_large
    except ValueError:
        raise ApiError(400, "the Content-Length header is not a number") from None
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY:
            raise too_large
    try:
        value = json.loads(body)
    except ValueError as e:
        raise ApiError(400, f"the request body is not JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "the request body nests arrays or objects too deeply") from None
    try:   # JSON may escape half a UTF-16 pair ("\ud800"), which is no Unicode text a tokenizer takes
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError as e:
        raise ApiError(400, f"the request body holds a lone UTF-16 surrogate ({e.object[e.start]!a}): "
                            f"text must be valid Unicode") from None
    except RecursionError:   # nested just short of json.loads' limit, past dumps'
        raise ApiError(400, "the request body nests arrays or objects too deeply") from None
    return value


def _authorized(request: Request, api_key: str) -> bool:
    given = request.headers.get("authorization", "").encode()
    return hmac.compare_digest(given, f"Bearer {api_key}".encode())   # in constant time


async def _http_error(request: Request, e: HTTPException) -> Response:
    """Starlette's own errors (an unknown path, a wrong method) in OpenAI's shape."""
    return JSONResponse(api.error_body(f"{request.method} {request.url.path}: {e.detail}", "invalid_request_error"),
                        e.status_code)


async def _server_error(request: Request, e: Exception) -> Response:
    """A bug: one line to the client (uvicorn logs the traceback), and serve on."""
    return JSONResponse(api.error_body(f"internal error: {type(e).__name__}: {e}", "server_error"), 500)
