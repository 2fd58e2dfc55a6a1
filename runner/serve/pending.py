"""A request between the event loop and its model's engine, whatever API it came in by: the body
read (with a limit), the request submitted to the engine of the model it names, its events
awaited on the event loop (the engine emits them on its thread), a streamed reply in the API's
framing, and a client's disconnect cancelling the request.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import anyio
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ..generation.decoding import Event
from ..generation.engine import Busy
from .errors import ApiError
from .models import Lease, Models
from .replies import Turn, generating

MAX_BODY = 32 << 20   # bytes: a phone photo in base64 (a 32k-token conversation is ~130 KB of JSON)


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


async def start(models: Models, body, make_turn) -> Pending:
    """The request submitted to the engine of the model it names, which it holds until its reply
    ends (the Pending's exit)."""
    lease = await models.lease(body.options.model)
    try:   # template, tokenizer, grammar: off the loop
        return Pending(lease, await run_in_threadpool(make_turn, generating(lease.served), body))
    except BaseException:
        lease.release()
        raise


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
        self.submitted, self.first = time.monotonic(), None   # for /metrics

    async def next(self) -> Event:
        event = await self.events.get()
        self.text.append(event.text)
        self.tokens += event.tokens
        if self.first is None and event.tokens:
            self.first = time.monotonic()
        self.done = event.finish_reason is not None
        if self.done:   # the engine is done with it: the model may go while the last chunks are sent
            self.lease.release()
            if self.lease.models.metrics is not None and event.usage is not None:
                self.lease.models.metrics.reply(self.served.name, event.usage, self.submitted, self.first,
                                                time.monotonic())
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


class Streamed(StreamingResponse):
    """A reply streamed in its API's framing (`frames`: the text of each frame, in turn). However
    the response ends (sent, the client gone, even before the first frame), its request is
    cancelled unless it finished."""

    def __init__(self, frames: AsyncIterator[str], pending: Pending, media_type: str = "text/event-stream"):
        super().__init__(frames, media_type=media_type,
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
