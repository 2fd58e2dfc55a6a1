"""The HTTP side of `nibble serve`: the Starlette app with every API's routes, the API key, each
API's error shape, and the OpenAI API's handlers.

Each loaded model's engine runs on a thread of its own; a handler takes the model its request
names (loading it if need be, runner/serve/models.py), submits the request and awaits its events
(runner/serve/pending.py). When a client disconnects, the request is cancelled, and the engine
frees the sequence at its next step.
"""
from __future__ import annotations

import hmac
import json
from collections.abc import AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from nibble.formats.errors import NibbleError
from ..generation.decoding import Event
from ..text.reasoning import Thinking
from ..text.tools import Call
from . import anthropic, api, embeddings, infill, llamacpp, ollama, ollama_models, rerank, responses
from .api import Stamp, tool_call
from .bodies import Images
from .errors import ApiError
from .guard import Callers, Guard
from .models import Models
from .pending import Pending, Streamed, read_json, start, until_disconnected
from .replies import ReplyParts, chat_delta, chat_turn, completion_turn


def make_app(models: Models, api_key: str | None = None, callers: Callers = Callers(),
             images: Images = Images(), metrics: bool = False) -> Starlette:
    """OpenAI's chat, completions, Responses and embeddings APIs, Anthropic's Messages API,
    ollama's API, Jina's and Cohere's rerank and llama.cpp's own routes over `models`, for the callers `callers` allows (by default: requests to
    localhost, from no web page but loopback's); with `api_key`, every route but /health and /
    asks for it. `images` reads the images in bodies (the handlers find it in app.state).
    `metrics`: GET /metrics (runner/serve/metrics.py)."""
    if metrics:
        from .metrics import Metrics   # prometheus-client: only for a server that counts
        models.metrics = Metrics(models)

    def route(path, handler, methods=("GET",), open=False):
        async def endpoint(request: Request) -> Response:
            response = await answer(request)
            if models.metrics is not None:
                models.metrics.answered(request.url.path, response.status_code)
            return response

        async def answer(request: Request) -> Response:
            try:
                if not open and api_key is not None and not _authorized(request, api_key):
                    raise ApiError(401, "wrong or missing API key: send it as 'Authorization: Bearer KEY' "
                                        "or 'x-api-key: KEY'", code="invalid_api_key")
                return await handler(models, request)
            except ApiError as e:
                return error_response(e, path)
            except NibbleError as e:   # what the model cannot take, said by the library
                return error_response(ApiError(400, str(e)), path)
        return Route(path, endpoint, methods=list(methods))

    app = Starlette(routes=[route("/v1/chat/completions", chat, ["POST"]),
                            route("/v1/completions", completions, ["POST"]),
                            route("/v1/responses", responses.create, ["POST"]),
                            route("/v1/messages", anthropic.messages, ["POST"]),
                            route("/v1/messages/count_tokens", anthropic.count_tokens, ["POST"]),
                            route("/v1/embeddings", embeddings.openai, ["POST"]),
                            *(route(path, rerank.rerank, ["POST"])
                              for path in ("/v1/rerank", "/v2/rerank", "/rerank", "/v1/reranking", "/reranking")),
                            route("/v1/models", list_models),
                            route("/v1/models/{id:path}", llamacpp.model_info),
                            route("/api/chat", ollama.chat, ["POST"]),
                            route("/api/generate", ollama.generate, ["POST"]),
                            route("/api/embed", embeddings.ollama, ["POST"]),
                            route("/api/embeddings", embeddings.ollama_older, ["POST"]),
                            route("/api/tags", ollama_models.tags),
                            route("/api/show", ollama_models.show, ["POST"]),
                            route("/api/create", ollama_models.create, ["POST"]),
                            route("/api/ps", ollama_models.running),
                            route("/api/version", ollama_models.version),
                            route("/", ollama_models.heartbeat, open=True),
                            route("/health", health, open=True),
                            route("/infill", infill.infill, ["POST"]),
                            route("/tokenize", llamacpp.tokenize, ["POST"]),
                            route("/detokenize", llamacpp.detokenize, ["POST"]),
                            route("/apply-template", llamacpp.apply_template, ["POST"]),
                            route("/props", llamacpp.props),
                            route("/lora-adapters", llamacpp.lora_adapters, ["GET", "POST"]),
                            *([route("/metrics", models.metrics.route)] if metrics else [])],
                    middleware=[Middleware(Guard, callers=callers, refuse=_forbidden)],
                    exception_handlers={HTTPException: _http_error, Exception: _server_error})
    app.state.images = images
    return app


# Each API answers errors in its own shape, picked by the request's path (the first prefix that
# matches); the rest in OpenAI's.
ERROR_SHAPES: list[tuple[str, Callable[[ApiError], dict]]] = [("/v1/messages", anthropic.error_body),
                                                              ("/api/", ollama.error_body)]


def error_response(e: ApiError, path: str = "") -> JSONResponse:
    shape = next((shape for prefix, shape in ERROR_SHAPES if path.startswith(prefix)), ApiError.body)
    headers = {"Retry-After": "1"} if e.status == 503 else None
    return JSONResponse(shape(e), e.status, headers=headers)


def _forbidden(scope, why: str) -> Response:
    return error_response(ApiError(403, why, code="forbidden"), scope.get("path", ""))


async def chat(models: Models, request: Request) -> Response:
    # on a worker thread: images are decoded, and with --allow-image-urls fetched
    body = await run_in_threadpool(api.parse_chat, await read_json(request), request.app.state.images)
    pending = await start(models, body, chat_turn)
    served = pending.served
    stamp, parts = Stamp.new("chatcmpl", served.name), ReplyParts(pending.turn.tool_names, served.family)
    if body.options.stream:
        return Streamed(openai_events(chat_chunks(stamp, pending, parts, body.options.include_usage)), pending)
    with pending:
        return await until_disconnected(request, chat_reply(stamp, pending, parts, body.options.logprobs))


async def completions(models: Models, request: Request) -> Response:
    body = api.parse_completion(await read_json(request))
    pending = await start(models, body, completion_turn)
    stamp = Stamp.new("cmpl", pending.served.name)
    if body.options.stream:
        return Streamed(openai_events(text_chunks(stamp, pending, body.options.include_usage)), pending)
    with pending:
        return await until_disconnected(request, text_reply(stamp, pending))


async def list_models(models: Models, request: Request) -> Response:
    return JSONResponse(api.models(list(models.refs), models.created))


async def health(models: Models, request: Request) -> Response:
    engines = models.engines()
    return JSONResponse({"status": "ok", "running": sum(e.running for e in engines),
                         "waiting": sum(e.waiting for e in engines)})


async def chat_chunks(stamp: Stamp, pending: Pending, parts: ReplyParts, include_usage: bool) -> AsyncIterator[dict]:
    yield api.chat_chunk(stamp, {"role": "assistant", "content": ""})   # at once: the client sees a reply start
    while True:
        event = await pending.next()
        if event.finish_reason == "error":
            yield _failed(event).body()
            return
        out = [chat_delta(p) for p in parts.feed(event)] or ([{"content": ""}] if event.logprobs else [])
        for i, delta in enumerate(out):
            yield api.chat_chunk(stamp, delta, logprobs=event.logprobs if i == 0 else None)
        if event.finish_reason:
            yield api.chat_chunk(stamp, {}, parts.finish_reason(event.finish_reason))
            if include_usage:
                yield api.usage_chunk(stamp, "chat.completion.chunk", event.usage)
            return


async def chat_reply(stamp: Stamp, pending: Pending, parts: ReplyParts, logprobs: int | None) -> Response:
    content, thinking, calls, tokens = [], [], [], []
    while True:
        event = await pending.next()
        if event.finish_reason == "error":
            return error_response(_failed(event))
        tokens += event.logprobs
        for part in parts.feed(event):
            if isinstance(part, Call):
                calls.append({k: v for k, v in tool_call(part.index, part.id, part.name, part.arguments).items()
                              if k != "index"})
            else:
                (thinking if isinstance(part, Thinking) else content).append(part.text)
        if event.finish_reason:
            break
    text = "".join(content)
    return JSONResponse(api.chat_completion(stamp, text if text or not calls else None, calls,
                                            parts.finish_reason(event.finish_reason),
                                            tokens if logprobs is not None else None, event.usage,
                                            "".join(thinking) or None))


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


async def openai_events(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    """OpenAI's server-sent events: `data:` and a chunk each, then `data: [DONE]`."""
    async for chunk in chunks:
        yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
    yield "data: [DONE]\n\n"


def _authorized(request: Request, api_key: str) -> bool:
    """The key as OpenAI's clients send it (Authorization: Bearer) or Anthropic's (x-api-key)."""
    bearer = request.headers.get("authorization", "").encode()
    key = request.headers.get("x-api-key", "").encode()
    # both compared, in constant time
    return hmac.compare_digest(bearer, f"Bearer {api_key}".encode()) | hmac.compare_digest(key, api_key.encode())


async def _http_error(request: Request, e: HTTPException) -> Response:
    """Starlette's own errors (an unknown path, a wrong method) in the shape of the path's API."""
    return error_response(ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}"),
                          request.url.path)


async def _server_error(request: Request, e: Exception) -> Response:
    """A bug: one line to the client (uvicorn logs the traceback), and serve on."""
    return error_response(ApiError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"),
                          request.url.path)
